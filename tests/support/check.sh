# Sourced by the tests' shell scripts: check DESCRIPTION COMMAND... runs
# COMMAND and prints "ok   DESCRIPTION" or "FAIL DESCRIPTION" (on the
# script's stdout even when the command's output is redirected), counting
# failures in $failures; it returns the command's verdict.
failures=0
exec 3>&1
check() {
  local what=$1
  shift
  if "$@"; then
    echo "ok   $what" >&3
  else
    echo "FAIL $what" >&3
    failures=$((failures + 1))
    return 1
  fi
}
