// Linked into the ASan/UBSan test binaries: fail on the first report, and do
// not count UCX's process-lifetime allocations (its global context caches)
// as leaks of ours.
extern "C" const char* __asan_default_options() { return "detect_leaks=1:detect_stack_use_after_return=0"; }
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libucs.so\nleak:libucp.so\nleak:libuct.so\nleak:libucm.so\nleak:libuct_\n";
}
