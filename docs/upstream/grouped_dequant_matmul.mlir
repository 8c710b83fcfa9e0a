// The grouped int4 dequantisation + contraction exactly as FuseDequantizationMatmul documents its input
// (extui -> uitofp -> subf(zero point) -> mulf(scale), 2 reduction dims), 4 rows, 256 x 128, groups of 32.

module {
util.func public @main(%x: tensor<4x4x32xf32>, %w: tensor<256x4x16xi8>, %s: tensor<256x4xf32>, %zpt: tensor<256x4xf32>) -> tensor<4x256xf32> {
  %wq = flow.tensor.bitcast %w : tensor<256x4x16xi8> -> tensor<256x4x32xi4>
  %e0 = tensor.empty() : tensor<256x4x32xf32>
  %deq = linalg.generic {indexing_maps = [affine_map<(o, a, b) -> (o, a, b)>, affine_map<(o, a, b) -> (o, a)>, affine_map<(o, a, b) -> (o, a)>, affine_map<(o, a, b) -> (o, a, b)>], iterator_types = ["parallel", "parallel", "parallel"]}
    ins(%wq, %s, %zpt : tensor<256x4x32xi4>, tensor<256x4xf32>, tensor<256x4xf32>) outs(%e0 : tensor<256x4x32xf32>) {
    ^bb0(%in: i4, %sc: f32, %zp: f32, %out: f32):
      %e = arith.extui %in : i4 to i32
      %f = arith.uitofp %e : i32 to f32
      %f2 = arith.subf %f, %zp : f32
      %r = arith.mulf %f2, %sc : f32
      linalg.yield %r : f32
  } -> tensor<256x4x32xf32>
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<4x256xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4x256xf32>) -> tensor<4x256xf32>
  %y = linalg.generic {indexing_maps = [affine_map<(m, o, a, b) -> (m, a, b)>, affine_map<(m, o, a, b) -> (o, a, b)>, affine_map<(m, o, a, b) -> (m, o)>], iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
    ins(%x, %deq : tensor<4x4x32xf32>, tensor<256x4x32xf32>) outs(%acc : tensor<4x256xf32>) {
    ^bb0(%a: f32, %b: f32, %c: f32):
      %p = arith.mulf %a, %b : f32
      %q = arith.addf %c, %p : f32
      linalg.yield %q : f32
  } -> tensor<4x256xf32>
  util.return %y : tensor<4x256xf32>
}
}
