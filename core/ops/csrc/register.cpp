// The operators as torch operators (torch.ops.kvchat.*), so that torch.compile's graph calls them.
#include "kvchat_ops.h"

using namespace kvchat;

TORCH_LIBRARY(kvchat, m) {
  m.def("scores(Tensor q, Tensor k) -> Tensor");
  m.def("values(Tensor p, Tensor v) -> Tensor");
  m.def("matvec(Tensor x, Tensor w) -> Tensor");
  m.def("project(Tensor x, Tensor n, float eps, Tensor w, Tensor? bias, Tensor cos, Tensor sin, int rotated) -> "
        "Tensor");
  m.def("block(Tensor q, Tensor k, Tensor v, Tensor lens, Tensor x, Tensor o_w, Tensor n2, float eps, Tensor gu_w, "
        "Tensor down_w) -> (Tensor, Tensor)");
  m.def("layer(Tensor x, Tensor n1, float eps1, Tensor qkv_w, Tensor? qkv_b, Tensor cos, Tensor sin, int nq, "
        "Tensor(a!) keys, Tensor(b!) values, int cap, int n, float scaling, Tensor o_w, Tensor n2, float eps2, "
        "Tensor gu_w, Tensor down_w, Tensor(c!)? sums=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("scores", &scores);
  m.impl("values", &values);
  m.impl("matvec", &matvec);
  m.impl("project", &project);
  m.impl("block", &block);
  m.impl("layer", &kvchat::layer);
}
