// sandgate-agent entry point: parse the config, run the loop, exit with its code.
#include <cstdio>

#include "sandbox-runtime/agent/agent.h"

extern char** environ;

int main(int argc, char** argv) {
  auto cfg = sg::agent::parse_config(argc, argv, environ);
  if (!cfg) {
    std::fprintf(stderr, "sandgate-agent: %s\n", cfg.error().message().c_str());
    return 2;
  }
  return sg::agent::run(*cfg);
}
