// A 64-row (prefill) matmul against an int4 weight, group-wise scales (group 32), at Llama-2-7B's MLP
// gate/up size (11008 x 4096), exactly as rules_dsa's `dsa::int4_matmul` op is imported: a bit-extend of the
// packed weight times its group's scale, then a contraction over (groups, group). The weight and scales are
// parameters (`model::w`, `model::s`), as in a built model. The fp32 twin, @main_f32, reads `model::wf`.

util.global private @w = #flow.parameter.named<"model"::"w"> : tensor<11008x128x16xi8>
util.global private @s = #flow.parameter.named<"model"::"s"> : tensor<11008x128xf32>
util.global private @wf = #flow.parameter.named<"model"::"wf"> : tensor<11008x4096xf32>

util.func public @main_int4(%x: tensor<64x4096xf32>) -> tensor<64x11008xf32> {
  %wp = util.global.load @w : tensor<11008x128x16xi8>
  %s = util.global.load @s : tensor<11008x128xf32>
  %xg = tensor.expand_shape %x [[0], [1, 2]] output_shape [64, 128, 32] : tensor<64x4096xf32> into tensor<64x128x32xf32>
  %wq = flow.tensor.bitcast %wp : tensor<11008x128x16xi8> -> tensor<11008x128x32xi4>
  %e0 = tensor.empty() : tensor<11008x128x32xf32>
  %deq = linalg.generic {indexing_maps = [affine_map<(o, a, b) -> (o, a, b)>, affine_map<(o, a, b) -> (o, a)>, affine_map<(o, a, b) -> (o, a, b)>], iterator_types = ["parallel", "parallel", "parallel"]}
    ins(%wq, %s : tensor<11008x128x32xi4>, tensor<11008x128xf32>) outs(%e0 : tensor<11008x128x32xf32>) {
    ^bb0(%in: i4, %sc: f32, %out: f32):
      %eight = arith.constant 8.0 : f32
      %f = arith.uitofp %in : i4 to f32
      %c = arith.subf %f, %eight : f32
      %r = arith.mulf %c, %sc : f32
      linalg.yield %r : f32
  } -> tensor<11008x128x32xf32>
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<64x11008xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e1 : tensor<64x11008xf32>) -> tensor<64x11008xf32>
  %y = linalg.generic {indexing_maps = [affine_map<(m, o, a, b) -> (m, a, b)>, affine_map<(m, o, a, b) -> (o, a, b)>, affine_map<(m, o, a, b) -> (m, o)>], iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
    ins(%xg, %deq : tensor<64x128x32xf32>, tensor<11008x128x32xf32>) outs(%acc : tensor<64x11008xf32>) {
    ^bb0(%a: f32, %b: f32, %c: f32):
      %p = arith.mulf %a, %b : f32
      %q = arith.addf %c, %p : f32
      linalg.yield %q : f32
  } -> tensor<64x11008xf32>
  util.return %y : tensor<64x11008xf32>
}

util.func public @main_f32(%x: tensor<64x4096xf32>) -> tensor<64x11008xf32> {
  %wf = util.global.load @wf : tensor<11008x4096xf32>
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<64x11008xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e1 : tensor<64x11008xf32>) -> tensor<64x11008xf32>
  %y = linalg.generic {indexing_maps = [affine_map<(m, o, k) -> (m, k)>, affine_map<(m, o, k) -> (o, k)>, affine_map<(m, o, k) -> (m, o)>], iterator_types = ["parallel", "parallel", "reduction"]}
    ins(%x, %wf : tensor<64x4096xf32>, tensor<11008x4096xf32>) outs(%acc : tensor<64x11008xf32>) {
    ^bb0(%a: f32, %b: f32, %c: f32):
      %p = arith.mulf %a, %b : f32
      %q = arith.addf %c, %p : f32
      linalg.yield %q : f32
  } -> tensor<64x11008xf32>
  util.return %y : tensor<64x11008xf32>
}
