// docs/repro/README.md, "The CPU decode copies K and V": a decode's Q.K^T (32
// sequences, 8 KV heads x 4, head dim 64, 144 keys in pages of 16, f32)
// reading K from the pool through the block table inside the contraction
// (tensor.extract in the body), against a gather and then the contraction.
// s[b,h,g,n] = sum_d q[b,h,g,d] * kpool[bt[b, n / 16], n % 16, h, d]
#q = affine_map<(b, h, g, n, d) -> (b, h, g, d)>
#o = affine_map<(b, h, g, n, d) -> (b, h, g, n)>
func.func @qk_extract(%q: tensor<32x8x4x64xf32>, %k: tensor<320x16x8x64xf32>, %bt: tensor<32x9xi32>) -> tensor<32x8x4x144xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32x8x4x144xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<32x8x4x144xf32>) -> tensor<32x8x4x144xf32>
  %r = linalg.generic {indexing_maps = [#q, #o], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%q : tensor<32x8x4x64xf32>) outs(%z : tensor<32x8x4x144xf32>) {
  ^bb0(%qv: f32, %acc: f32):
    %b = linalg.index 0 : index
    %h = linalg.index 1 : index
    %n = linalg.index 3 : index
    %d = linalg.index 4 : index
    %c16 = arith.constant 16 : index
    %pi = arith.divui %n, %c16 : index
    %row = arith.remui %n, %c16 : index
    %p32 = tensor.extract %bt[%b, %pi] : tensor<32x9xi32>
    %p = arith.index_cast %p32 : i32 to index
    %kv = tensor.extract %k[%p, %row, %h, %d] : tensor<320x16x8x64xf32>
    %m = arith.mulf %qv, %kv : f32
    %s = arith.addf %acc, %m : f32
    linalg.yield %s : f32
  } -> tensor<32x8x4x144xf32>
  return %r : tensor<32x8x4x144xf32>
}
// The same as the library does it: a gather, then the contraction.
func.func @qk_gather(%q: tensor<32x8x4x64xf32>, %k: tensor<320x16x8x64xf32>, %bt: tensor<32x9xi32>) -> tensor<32x8x4x144xf32> {
  %eg = tensor.empty() : tensor<32x9x16x8x64xf32>
  %g = linalg.generic {indexing_maps = [affine_map<(b, p, r, h, d) -> (b, p, r, h, d)>], iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}
      outs(%eg : tensor<32x9x16x8x64xf32>) {
  ^bb0(%out: f32):
    %b = linalg.index 0 : index
    %pi = linalg.index 1 : index
    %row = linalg.index 2 : index
    %h = linalg.index 3 : index
    %d = linalg.index 4 : index
    %p32 = tensor.extract %bt[%b, %pi] : tensor<32x9xi32>
    %p = arith.index_cast %p32 : i32 to index
    %kv = tensor.extract %k[%p, %row, %h, %d] : tensor<320x16x8x64xf32>
    linalg.yield %kv : f32
  } -> tensor<32x9x16x8x64xf32>
  %kg = tensor.collapse_shape %g [[0], [1, 2], [3], [4]] : tensor<32x9x16x8x64xf32> into tensor<32x144x8x64xf32>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32x8x4x144xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<32x8x4x144xf32>) -> tensor<32x8x4x144xf32>
  %r = linalg.generic {indexing_maps = [#q, affine_map<(b, h, g, n, d) -> (b, n, h, d)>, #o], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %kg : tensor<32x8x4x64xf32>, tensor<32x144x8x64xf32>) outs(%z : tensor<32x8x4x144xf32>) {
  ^bb0(%qv: f32, %kv: f32, %acc: f32):
    %m = arith.mulf %qv, %kv : f32
    %s = arith.addf %acc, %m : f32
    linalg.yield %s : f32
  } -> tensor<32x8x4x144xf32>
  return %r : tensor<32x8x4x144xf32>
}
