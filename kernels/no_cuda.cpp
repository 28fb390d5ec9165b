// Linked when the build has no CUDA backend (TROUPE_CUDA=OFF or no nvcc).
#include "kernels/backend.hpp"

namespace troupe::kernels {
std::unique_ptr<Backend> make_cuda_backend(int) { return nullptr; }
bool cuda_backend_compiled() { return false; }
}  // namespace troupe::kernels
