// The CPU prefill's contractions in isolation (docs/repro/README.md, "bf16
// contractions on the CPU", the fp16 part): QK^T as the explicit kernel writes
// it (a 6-D GQA generic, f16 in, f32 accumulator) and as one named
// batch_matmul after explicit transposes; PV as a named batch_matmul.
// Shapes of one 64-row chunk of a chunked prefill (2 sequences, 8/4 heads
// of 128, 1152 keys) are given at run time.
!q5 = tensor<?x?x8x4x128xf16>
!k4 = tensor<?x?x8x128xf16>
!s5 = tensor<?x8x4x?x?xf32>
func.func @qk_generic(%q: !q5, %k: !k4) -> !s5 {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %b = tensor.dim %q, %c0 : !q5
  %m = tensor.dim %q, %c1 : !q5
  %n = tensor.dim %k, %c1 : !k4
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty(%b, %m, %n) : !s5
  %z = linalg.fill ins(%zero : f32) outs(%e : !s5) -> !s5
  %r = linalg.generic {
      indexing_maps = [affine_map<(b, h, g, m, n, d) -> (b, m, h, g, d)>,
                       affine_map<(b, h, g, m, n, d) -> (b, n, h, d)>,
                       affine_map<(b, h, g, m, n, d) -> (b, h, g, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %k : !q5, !k4) outs(%z : !s5) {
  ^bb0(%qv: f16, %kv: f16, %acc: f32):
    %a = arith.extf %qv : f16 to f32
    %bb = arith.extf %kv : f16 to f32
    %p = arith.mulf %a, %bb : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  } -> !s5
  return %r : !s5
}
func.func @qk_bmm(%q: !q5, %k: !k4) -> tensor<?x?x?xf32> {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %b = tensor.dim %q, %c0 : !q5
  %m = tensor.dim %q, %c1 : !q5
  %n = tensor.dim %k, %c1 : !k4
  %zero = arith.constant 0.0 : f32
  %qt_e = tensor.empty(%b, %m) : tensor<?x8x4x?x128xf16>
  %qt = linalg.transpose ins(%q : !q5) outs(%qt_e : tensor<?x8x4x?x128xf16>) permutation = [0, 2, 3, 1, 4]
  %kt_e = tensor.empty(%b, %n) : tensor<?x8x?x128xf16>
  %kt = linalg.transpose ins(%k : !k4) outs(%kt_e : tensor<?x8x?x128xf16>) permutation = [0, 2, 1, 3]
  %q3 = tensor.collapse_shape %qt [[0, 1], [2, 3], [4]] : tensor<?x8x4x?x128xf16> into tensor<?x?x128xf16>
  %k3 = tensor.collapse_shape %kt [[0, 1], [2], [3]] : tensor<?x8x?x128xf16> into tensor<?x?x128xf16>
  %bh = tensor.dim %q3, %c0 : tensor<?x?x128xf16>
  %gm = tensor.dim %q3, %c1 : tensor<?x?x128xf16>
  %e = tensor.empty(%bh, %gm, %n) : tensor<?x?x?xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<?x?x?xf32>) -> tensor<?x?x?xf32>
  %r = linalg.batch_matmul indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>, affine_map<(b, m, n, k) -> (b, n, k)>, affine_map<(b, m, n, k) -> (b, m, n)>]
      ins(%q3, %k3 : tensor<?x?x128xf16>, tensor<?x?x128xf16>) outs(%z : tensor<?x?x?xf32>) -> tensor<?x?x?xf32>
  return %r : tensor<?x?x?xf32>
}
func.func @pv_dyn(%a: tensor<?x?x?xf16>, %b: tensor<?x?x128xf16>) -> tensor<?x?x128xf32> {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %bb = tensor.dim %a, %c0 : tensor<?x?x?xf16>
  %m = tensor.dim %a, %c1 : tensor<?x?x?xf16>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty(%bb, %m) : tensor<?x?x128xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<?x?x128xf32>) -> tensor<?x?x128xf32>
  %r = linalg.batch_matmul ins(%a, %b : tensor<?x?x?xf16>, tensor<?x?x128xf16>) outs(%z : tensor<?x?x128xf32>) -> tensor<?x?x128xf32>
  return %r : tensor<?x?x128xf32>
}
// The same two contractions with the chunk's sizes static (16 = 2 sequences
// x 8 KV heads, 256 = 4 query heads x 64 rows, 1152 keys, head dim 128):
// what dynamic sizes cost, apart from the shapes themselves.
func.func @qk_static(%q: tensor<16x256x128xf16>, %k: tensor<16x1152x128xf16>) -> tensor<16x256x1152xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<16x256x1152xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<16x256x1152xf32>) -> tensor<16x256x1152xf32>
  %r = linalg.batch_matmul indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>, affine_map<(b, m, n, k) -> (b, n, k)>, affine_map<(b, m, n, k) -> (b, m, n)>]
      ins(%q, %k : tensor<16x256x128xf16>, tensor<16x1152x128xf16>) outs(%z : tensor<16x256x1152xf32>) -> tensor<16x256x1152xf32>
  return %r : tensor<16x256x1152xf32>
}
func.func @pv_static(%a: tensor<16x256x1152xf16>, %b: tensor<16x1152x128xf16>) -> tensor<16x256x128xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<16x256x128xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<16x256x128xf32>) -> tensor<16x256x128xf32>
  %r = linalg.batch_matmul ins(%a, %b : tensor<16x256x1152xf16>, tensor<16x1152x128xf16>) outs(%z : tensor<16x256x128xf32>) -> tensor<16x256x128xf32>
  return %r : tensor<16x256x128xf32>
}
// Only the rows (4 query heads x 64 rows) and the head dim static, the
// batch and the keys dynamic: a kernel with fixed row chunks would be so.
func.func @qk_rows_static(%q: tensor<?x256x128xf16>, %k: tensor<?x?x128xf16>) -> tensor<?x256x?xf32> {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %b = tensor.dim %q, %c0 : tensor<?x256x128xf16>
  %n = tensor.dim %k, %c1 : tensor<?x?x128xf16>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty(%b, %n) : tensor<?x256x?xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<?x256x?xf32>) -> tensor<?x256x?xf32>
  %r = linalg.batch_matmul indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>, affine_map<(b, m, n, k) -> (b, n, k)>, affine_map<(b, m, n, k) -> (b, m, n)>]
      ins(%q, %k : tensor<?x256x128xf16>, tensor<?x?x128xf16>) outs(%z : tensor<?x256x?xf32>) -> tensor<?x256x?xf32>
  return %r : tensor<?x256x?xf32>
}
func.func @pv_rows_static(%a: tensor<?x256x?xf16>, %v: tensor<?x?x128xf16>) -> tensor<?x256x128xf32> {
  %c0 = arith.constant 0 : index
  %b = tensor.dim %a, %c0 : tensor<?x256x?xf16>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty(%b) : tensor<?x256x128xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<?x256x128xf32>) -> tensor<?x256x128xf32>
  %r = linalg.batch_matmul ins(%a, %v : tensor<?x256x?xf16>, tensor<?x?x128xf16>) outs(%z : tensor<?x256x128xf32>) -> tensor<?x256x128xf32>
  return %r : tensor<?x256x128xf32>
}
