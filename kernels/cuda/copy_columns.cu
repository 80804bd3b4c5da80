// copy_columns: a run of columns of every row, one strided device copy.
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

void CudaBackend::run_copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col,
                                   int64_t width) {
  const int64_t wd = dst.dim(dst.ndim() - 1), ws = src.dim(src.ndim() - 1);
  const int64_t rows = wd > 0 ? dst.numel() / wd : 0;
  if (rows == 0 || width == 0) return;
  const size_t es = dtype_size(dst.dtype);
  KILN_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.data) + dst_col * es, wd * es,
                                    static_cast<const char*>(src.data) + src_col * es, ws * es,
                                    width * es, rows, cudaMemcpyDeviceToDevice, stream_));
}

}  // namespace kiln
