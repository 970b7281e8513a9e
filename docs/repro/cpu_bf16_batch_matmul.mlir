func.func @qk(%q: tensor<8x2048x128xbf16>, %k: tensor<8x128x512xbf16>) -> tensor<8x2048x512xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x2048x512xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<8x2048x512xf32>) -> tensor<8x2048x512xf32>
  %r = linalg.batch_matmul ins(%q, %k : tensor<8x2048x128xbf16>, tensor<8x128x512xbf16>) outs(%f : tensor<8x2048x512xf32>) -> tensor<8x2048x512xf32>
  return %r : tensor<8x2048x512xf32>
}
