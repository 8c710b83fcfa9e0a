// Dispatch spec of act (batch=1) for x86_64-v4, written by `dsa tune-dispatches`; evidence in resnet_policy.x86_64-v4.spec.evidence.json.
// Each entry matches a dispatch's root op as IREE configures it and sets the measured lowering_config (and, where it says so, the ukernels its dispatch is lowered with).
module @dsa_dispatch_spec attributes { transform.with_named_sequence } {
  transform.named_sequence @dsa_set_config(%op: !transform.any_op {transform.readonly},
      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {
    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "dsa.tuned" = %name : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @match_conv_512x15x20x512x3x3_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<1x32x17x22x16xf32>, %a1: tensor<32x32x3x3x16x16xf32>, %a2: tensor<1x32x15x20x16xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3, d4, d5, d6, d7, d8) -> (d0, d4, d2 + d5, d3 + d6, d8)>, affine_map<(d0, d1, d2, d3, d4, d5, d6, d7, d8) -> (d1, d4, d5, d6, d8, d7)>, affine_map<(d0, d1, d2, d3, d4, d5, d6, d7, d8) -> (d0, d1, d2, d3, d7)>], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction", "parallel", "reduction"]} ins(%a0, %a1 : tensor<1x32x17x22x16xf32>, tensor<32x32x3x3x16x16xf32>) outs(%a2 : tensor<1x32x15x20x16xf32>) attrs =  {lowering_config = #iree_cpu.lowering_config<distribution = [0, 4, 5, 0, 0, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 16, 0, 0, 0, 16, 0], vector_reduction = [0, 0, 0, 0, 1, 1, 1, 0, 16]>} {
      ^bb0(%in: f32, %in_0: f32, %out: f32):
      %22 = arith.mulf %in, %in_0 : f32
      %23 = arith.addf %22, %out : f32
      linalg.yield %23 : f32
      } -> tensor<1x32x15x20x16xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [0, 4, 15, 0, 0, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 10, 0, 0, 0, 16, 0], vector_reduction = [0, 0, 0, 0, 1, 1, 1, 0, 16]> -> !transform.any_param
    %name = transform.param.constant "conv_512x15x20x512x3x3_f32" -> !transform.any_param
    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @dsa_set_softmax_8x302x302xf32_dispatch_tensor_store(%op: !transform.any_op {transform.readonly},
      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {
    %fn = transform.get_parent_op %op <op_name = "func.func"> : (!transform.any_op) -> !transform.any_op
    %s0 = transform.structured.match attributes {lowering_config = #iree_cpu.lowering_config<vector_common_parallel = [1, 2, 0], vector_reduction = [0, 0, 16]>} in %fn
      : (!transform.any_op) -> !transform.any_op
    %c0 = transform.param.constant #iree_cpu.lowering_config<vector_common_parallel = [1, 2, 0], vector_reduction = [0, 0, 64]> -> !transform.any_param
    transform.annotate %s0 "lowering_config" = %c0 : !transform.any_op, !transform.any_param
    %s1 = transform.structured.match attributes {lowering_config = #iree_cpu.lowering_config<vector_common_parallel = [1, 2, 0], vector_inner_parallel = [0, 0, 16]>} in %fn
      : (!transform.any_op) -> !transform.any_op
    %c1 = transform.param.constant #iree_cpu.lowering_config<vector_common_parallel = [1, 2, 0], vector_inner_parallel = [0, 0, 32]> -> !transform.any_param
    transform.annotate %s1 "lowering_config" = %c1 : !transform.any_op, !transform.any_param
    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "dsa.tuned" = %name : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @match_softmax_8x302x302xf32_dispatch_tensor_store(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<8x302x302xf32>, %a1: tensor<8x302xf32>, %a2: tensor<8x302xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>, affine_map<(d0, d1, d2) -> (d0, d1)>], iterator_types = ["parallel", "parallel", "reduction"]} ins(%a0, %a1 : tensor<8x302x302xf32>, tensor<8x302xf32>) outs(%a2 : tensor<8x302xf32>) attrs =  {lowering_config = #iree_cpu.lowering_config<distribution = [8, 2, 0], vector_common_parallel = [1, 2, 0], vector_reduction = [0, 0, 16]>} {
      ^bb0(%in: f32, %in_1: f32, %out: f32):
      %10 = arith.subf %in, %in_1 : f32
      %11 = math.exp %10 : f32
      %12 = arith.addf %11, %out : f32
      linalg.yield %12 : f32
      } -> tensor<8x302xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [1, 2, 0], vector_common_parallel = [1, 2, 0], vector_reduction = [0, 0, 64]> -> !transform.any_param
    %name = transform.param.constant "softmax_8x302x302xf32_dispatch_tensor_store" -> !transform.any_param
    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @dsa_set_softmax_8x100x302xf32_dispatch_tensor_store(%op: !transform.any_op {transform.readonly},
      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {
    %fn = transform.get_parent_op %op <op_name = "func.func"> : (!transform.any_op) -> !transform.any_op
    %s0 = transform.structured.match attributes {lowering_config = #iree_cpu.lowering_config<vector_common_parallel = [1, 8, 0], vector_reduction = [0, 0, 16]>} in %fn
      : (!transform.any_op) -> !transform.any_op
    %c0 = transform.param.constant #iree_cpu.lowering_config<vector_common_parallel = [1, 8, 0], vector_reduction = [0, 0, 128]> -> !transform.any_param
    transform.annotate %s0 "lowering_config" = %c0 : !transform.any_op, !transform.any_param
    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "dsa.tuned" = %name : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @match_softmax_8x100x302xf32_dispatch_tensor_store(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<8x100x302xf32>, %a1: tensor<8x100xf32>, %a2: tensor<8x100xf32>):
      %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>, affine_map<(d0, d1, d2) -> (d0, d1)>], iterator_types = ["parallel", "parallel", "reduction"]} ins(%a0, %a1 : tensor<8x100x302xf32>, tensor<8x100xf32>) outs(%a2 : tensor<8x100xf32>) attrs =  {lowering_config = #iree_cpu.lowering_config<distribution = [2, 25, 0], vector_common_parallel = [1, 8, 0], vector_reduction = [0, 0, 16]>} {
      ^bb0(%in: f32, %in_1: f32, %out: f32):
      %10 = arith.subf %in, %in_1 : f32
      %11 = math.exp %10 : f32
      %12 = arith.addf %11, %out : f32
      linalg.yield %12 : f32
      } -> tensor<8x100xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [8, 8, 0], vector_common_parallel = [1, 8, 0], vector_reduction = [0, 0, 128]> -> !transform.any_param
    %name = transform.param.constant "softmax_8x100x302xf32_dispatch_tensor_store" -> !transform.any_param
    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @__dsa_tune(%root: !transform.any_op {transform.consumed}) {
    %res = transform.foreach_match in %root
        @match_conv_512x15x20x512x3x3_f32 -> @dsa_set_config,
        @match_softmax_8x302x302xf32_dispatch_tensor_store -> @dsa_set_softmax_8x302x302xf32_dispatch_tensor_store,
        @match_softmax_8x100x302xf32_dispatch_tensor_store -> @dsa_set_softmax_8x100x302xf32_dispatch_tensor_store
      : (!transform.any_op) -> !transform.any_op
    transform.yield
  }
}
