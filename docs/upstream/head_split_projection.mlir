// One attention projection as a transformer layer writes it: y = x @ Wᵀ (302 tokens, 512 → 512), then the
// head split [302, 512] → [302, 8, 64] → [8, 302, 64] that the attention's batch matmuls read.
util.global private @w = #flow.parameter.named<"model"::"w"> : tensor<512x512xf32>
util.func public @main(%x: tensor<302x512xf32>) -> tensor<8x302x64xf32> {
  %w = util.global.load @w : tensor<512x512xf32>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<302x512xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<302x512xf32>) -> tensor<302x512xf32>
  %y = linalg.matmul indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>, affine_map<(m, n, k) -> (m, n)>]
      ins(%x, %w : tensor<302x512xf32>, tensor<512x512xf32>) outs(%acc : tensor<302x512xf32>) -> tensor<302x512xf32>
  %heads = tensor.expand_shape %y [[0], [1, 2]] output_shape [302, 8, 64] : tensor<302x512xf32> into tensor<302x8x64xf32>
  %t = tensor.empty() : tensor<8x302x64xf32>
  %split = linalg.transpose ins(%heads : tensor<302x8x64xf32>) outs(%t : tensor<8x302x64xf32>) permutation = [1, 0, 2]
  util.return %split : tensor<8x302x64xf32>
}
