// The sandgate command line: serve, and the admin commands (tenant, key,
// llm key/upstream/usage, template, kvm check). Library code, so tests can
// drive it in-process.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace sg::gateway {

// Runs one command; returns the exit code. Output to out, errors to err.
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

std::string default_data_dir();

}  // namespace sg::gateway
