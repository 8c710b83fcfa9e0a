// Dispatch spec of act for x86_64-v3, written by `dsa tune-dispatches --winograd`; evidence in resnet_policy.x86_64-v3.spec.evidence.json.
// Each entry rewrites the 3x3 stride-1 convolutions of its weight shape into a zero fill by Winograd F(6x6, 3x3).
module @dsa_dispatch_spec attributes { transform.with_named_sequence } {
  transform.named_sequence @dsa_winograd(%op: !transform.any_op {transform.readonly},
      %name: !transform.any_param {transform.readonly}) {
    transform.annotate %op "__winograd_conv" : !transform.any_op
    transform.annotate %op "dsa.rewritten" = %name : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @rewrite_conv3x3_64x64(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param) {
    transform.match.operation_name %op ["linalg.conv_2d_nchw_fchw"] : !transform.any_op
    %w = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %w = tensor<64x64x3x3xf32> : !transform.any_value
    // Only a convolution into a zero fill: the rewrite drops the init (a bias there would be lost).
    %init = transform.get_producer_of_operand %op[2] : (!transform.any_op) -> !transform.any_op
    %fill_ins, %fill_outs = transform.iree.match.cast_compatible_dag_from_root %init {
    ^bb0(%a: tensor<?x?x?x?xf32>):
      %zero = arith.constant 0.000000e+00 : f32
      %f = linalg.fill ins(%zero : f32) outs(%a : tensor<?x?x?x?xf32>) -> tensor<?x?x?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %name = transform.param.constant "conv3x3_64x64" -> !transform.any_param
    transform.yield %op, %name : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @rewrite_conv3x3_128x128(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param) {
    transform.match.operation_name %op ["linalg.conv_2d_nchw_fchw"] : !transform.any_op
    %w = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %w = tensor<128x128x3x3xf32> : !transform.any_value
    // Only a convolution into a zero fill: the rewrite drops the init (a bias there would be lost).
    %init = transform.get_producer_of_operand %op[2] : (!transform.any_op) -> !transform.any_op
    %fill_ins, %fill_outs = transform.iree.match.cast_compatible_dag_from_root %init {
    ^bb0(%a: tensor<?x?x?x?xf32>):
      %zero = arith.constant 0.000000e+00 : f32
      %f = linalg.fill ins(%zero : f32) outs(%a : tensor<?x?x?x?xf32>) -> tensor<?x?x?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %name = transform.param.constant "conv3x3_128x128" -> !transform.any_param
    transform.yield %op, %name : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @rewrite_conv3x3_256x256(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param) {
    transform.match.operation_name %op ["linalg.conv_2d_nchw_fchw"] : !transform.any_op
    %w = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %w = tensor<256x256x3x3xf32> : !transform.any_value
    // Only a convolution into a zero fill: the rewrite drops the init (a bias there would be lost).
    %init = transform.get_producer_of_operand %op[2] : (!transform.any_op) -> !transform.any_op
    %fill_ins, %fill_outs = transform.iree.match.cast_compatible_dag_from_root %init {
    ^bb0(%a: tensor<?x?x?x?xf32>):
      %zero = arith.constant 0.000000e+00 : f32
      %f = linalg.fill ins(%zero : f32) outs(%a : tensor<?x?x?x?xf32>) -> tensor<?x?x?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %name = transform.param.constant "conv3x3_256x256" -> !transform.any_param
    transform.yield %op, %name : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @rewrite_conv3x3_512x512(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param) {
    transform.match.operation_name %op ["linalg.conv_2d_nchw_fchw"] : !transform.any_op
    %w = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %w = tensor<512x512x3x3xf32> : !transform.any_value
    // Only a convolution into a zero fill: the rewrite drops the init (a bias there would be lost).
    %init = transform.get_producer_of_operand %op[2] : (!transform.any_op) -> !transform.any_op
    %fill_ins, %fill_outs = transform.iree.match.cast_compatible_dag_from_root %init {
    ^bb0(%a: tensor<?x?x?x?xf32>):
      %zero = arith.constant 0.000000e+00 : f32
      %f = linalg.fill ins(%zero : f32) outs(%a : tensor<?x?x?x?xf32>) -> tensor<?x?x?x?xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %name = transform.param.constant "conv3x3_512x512" -> !transform.any_param
    transform.yield %op, %name : !transform.any_op, !transform.any_param
  }
  transform.named_sequence @__dsa_preprocess(
      %root: !transform.any_op {transform.consumed}) {
    %res = transform.foreach_match in %root
        @rewrite_conv3x3_64x64 -> @dsa_winograd,
        @rewrite_conv3x3_128x128 -> @dsa_winograd,
        @rewrite_conv3x3_256x256 -> @dsa_winograd,
        @rewrite_conv3x3_512x512 -> @dsa_winograd
      : (!transform.any_op) -> !transform.any_op
    transform.yield
  }
}
