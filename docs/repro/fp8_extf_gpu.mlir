// IREE 3.13, sm_80: widening an fp8 tensor to f16 in an elementwise dispatch
// fails ("LLVM Translation failed for operation:
// builtin.unrealized_conversion_cast", vector<8xi8> -> vector<8xf8E4M3FNUZ>).
// It compiles for llvm-cpu and, in this small form, for gfx942.
//   iree-compile fp8_extf_gpu.mlir --iree-hal-target-device=cuda --iree-cuda-target=sm_80 -o /dev/null
func.func @widen(%x: tensor<4x?x8x128xi8>, %len: tensor<4xi32>) -> tensor<4x?x8x128xf16> {
  %c1 = arith.constant 1 : index
  %n = tensor.dim %x, %c1 : tensor<4x?x8x128xi8>
  %f8 = tensor.bitcast %x : tensor<4x?x8x128xi8> to tensor<4x?x8x128xf8E4M3FNUZ>
  %e = tensor.empty(%n) : tensor<4x?x8x128xf16>
  %r = linalg.generic {
      indexing_maps = [affine_map<(b, n, h, d) -> (b, n, h, d)>, affine_map<(b, n, h, d) -> (b)>,
                       affine_map<(b, n, h, d) -> (b, n, h, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%f8, %len : tensor<4x?x8x128xf8E4M3FNUZ>, tensor<4xi32>) outs(%e : tensor<4x?x8x128xf16>) {
  ^bb0(%v: f8E4M3FNUZ, %l: i32, %o: f16):
    %i = linalg.index 1 : index
    %ii = arith.index_cast %i : index to i32
    %ok = arith.cmpi slt, %ii, %l : i32
    %w = arith.extf %v : f8E4M3FNUZ to f32
    %h = arith.truncf %w : f32 to f16
    %z = arith.constant 0.0 : f16
    %s = arith.select %ok, %h, %z : f16
    linalg.yield %s : f16
  } -> tensor<4x?x8x128xf16>
  return %r : tensor<4x?x8x128xf16>
}
