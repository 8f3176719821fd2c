// mrctl: the command-line client of mrd. See docs/CLI.md.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "client/mrctl/commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  mrd::mrctl::Environment env;
  if (const char* session = std::getenv("MRD_SESSION"); session != nullptr) {
    env.session = session;
  }
  return mrd::mrctl::Run(args, env, stdout, stderr);
}
