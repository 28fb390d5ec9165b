# Every external library troupe links, found the way that works on Debian 12
# (see docs/architecture.md and ../shared/docs/STACK.md).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(GTest 1.12 REQUIRED)
find_package(benchmark 1.7 REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog 1.10 REQUIRED)
find_package(CLI11 QUIET)
find_package(yaml-cpp 0.7 REQUIRED)   # target: yaml-cpp (topology manifests)
# Messages and transport (STACK.md sections 4 and 5). CapnProto needs project(... C CXX).
find_package(CapnProto 0.9 REQUIRED)   # CapnProto::capnp, capnp_generate_cpp()
find_package(ucx 1.13 REQUIRED)        # ucx::ucp ucx::ucs

# OpenBLAS: Debian's cblas.h lives in /usr/include/x86_64-linux-gnu/openblas-pthread.
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
add_library(troupe_blas INTERFACE)
target_link_libraries(troupe_blas INTERFACE PkgConfig::OPENBLAS)

pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
