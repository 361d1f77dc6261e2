// sandgate: the gateway binary.
#include <iostream>

#include "gateway/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return sg::gateway::run_cli(args, std::cout, std::cerr);
}
