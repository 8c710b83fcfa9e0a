// Dispatch spec of act (batch=1) for x86_64-v3, written by `dsa tune-dispatches`; evidence in resnet_policy.x86_64-v3.spec.evidence.json.
// Each entry matches a dispatch's root op as IREE configures it and sets the measured lowering_config (and, where it says so, the ukernels its dispatch is lowered with).
// Its preprocess entries are carried from the spec the profile was taken with (conv3x3_64x64, conv3x3_128x128, conv3x3_256x256, conv3x3_512x512): their evidence is under carried_rewrites.
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
  transform.named_sequence @dsa_set_config(%op: !transform.any_op {transform.readonly},
      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly}) {
    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "dsa.tuned" = %name : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @dsa_set_config_and_ukernels(%op: !transform.any_op {transform.readonly},
      %config: !transform.any_param {transform.readonly}, %name: !transform.any_param {transform.readonly},
      %target: !transform.any_param {transform.readonly}) {
    transform.annotate %op "lowering_config" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "dsa.tuned" = %name : !transform.any_op, !transform.any_param
    %fn = transform.get_parent_op %op <op_name = "func.func"> : (!transform.any_op) -> !transform.any_op
    transform.annotate %fn "hal.executable.target" = %target : !transform.any_op, !transform.any_param
    transform.yield
  }
  transform.named_sequence @match_matmul_like_302x512x3200_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<38x3200x8x1xf32>, %a1: tensor<64x3200x8x1xf32>, %a2: tensor<38x64x8x8xf32>):
      %r = linalg.mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 1, 0, 0, 0, 0], vector_common_parallel = [1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 1, 0, 0, 1]>} ins(%a0, %a1 : tensor<38x3200x8x1xf32>, tensor<64x3200x8x1xf32>) outs(%a2 : tensor<38x64x8x8xf32>) -> tensor<38x64x8x8xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [2, 16, 0, 0, 0, 0], vector_common_parallel = [2, 8, 0, 8, 8, 0], vector_reduction = [0, 0, 1, 0, 0, 1]> -> !transform.any_param
    %name = transform.param.constant "matmul_like_302x512x3200_f32" -> !transform.any_param
    transform.yield %op, %config, %name : !transform.any_op, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @match_matmul_like_64x540x64x64_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<64x8x64x8x1xf32>, %a1: tensor<64x68x64x8x1xf32>, %a2: tensor<64x8x68x8x8xf32>):
      %r = linalg.batch_mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 4, 17, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]>} ins(%a0, %a1 : tensor<64x8x64x8x1xf32>, tensor<64x68x64x8x1xf32>) outs(%a2 : tensor<64x8x68x8x8xf32>) -> tensor<64x8x68x8x8xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [1, 2, 34, 0, 0, 0, 0], vector_common_parallel = [1, 1, 17, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]> -> !transform.any_param
    %name = transform.param.constant "matmul_like_64x540x64x64_f32" -> !transform.any_param
    %target = transform.param.constant #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {cpu = "x86-64-v3", cpu_features = "+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave", data_layout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-i128:128-f80:128-n8:16:32:64-S128", debug_symbols = false, iree.encoding.resolver = #iree_cpu.cpu_encoding_resolver<>, max_stack_allocation_size = 131072 : i64, native_vector_size = 32 : i64, target_triple = "x86_64-unknown-unknown-eabi-elf", ukernels = "mmt4d,pack"}> -> !transform.any_param
    transform.yield %op, %config, %name, %target : !transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @match_matmul_like_64x12x512x512_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<64x2x512x8x1xf32>, %a1: tensor<64x64x512x8x1xf32>, %a2: tensor<64x2x64x8x8xf32>):
      %r = linalg.batch_mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 2, 8, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]>} ins(%a0, %a1 : tensor<64x2x512x8x1xf32>, tensor<64x64x512x8x1xf32>) outs(%a2 : tensor<64x2x64x8x8xf32>) -> tensor<64x2x64x8x8xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [1, 2, 8, 0, 0, 0, 0], vector_common_parallel = [1, 2, 8, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]> -> !transform.any_param
    %name = transform.param.constant "matmul_like_64x12x512x512_f32" -> !transform.any_param
    %target = transform.param.constant #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {cpu = "x86-64-v3", cpu_features = "+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave", data_layout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-i128:128-f80:128-n8:16:32:64-S128", debug_symbols = false, iree.encoding.resolver = #iree_cpu.cpu_encoding_resolver<>, max_stack_allocation_size = 131072 : i64, native_vector_size = 32 : i64, target_triple = "x86_64-unknown-unknown-eabi-elf", ukernels = "mmt4d,pack"}> -> !transform.any_param
    transform.yield %op, %config, %name, %target : !transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @match_matmul_like_64x140x128x128_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<64x16x128x8x1xf32>, %a1: tensor<64x18x128x8x1xf32>, %a2: tensor<64x16x18x8x8xf32>):
      %r = linalg.batch_mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 8, 6, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]>} ins(%a0, %a1 : tensor<64x16x128x8x1xf32>, tensor<64x18x128x8x1xf32>) outs(%a2 : tensor<64x16x18x8x8xf32>) -> tensor<64x16x18x8x8xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [1, 8, 6, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]> -> !transform.any_param
    %name = transform.param.constant "matmul_like_64x140x128x128_f32" -> !transform.any_param
    %target = transform.param.constant #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {cpu = "x86-64-v3", cpu_features = "+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave", data_layout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-i128:128-f80:128-n8:16:32:64-S128", debug_symbols = false, iree.encoding.resolver = #iree_cpu.cpu_encoding_resolver<>, max_stack_allocation_size = 131072 : i64, native_vector_size = 32 : i64, target_triple = "x86_64-unknown-unknown-eabi-elf", ukernels = "mmt4d,pack"}> -> !transform.any_param
    transform.yield %op, %config, %name, %target : !transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @match_matmul_like_64x35x256x256_f32(%op: !transform.any_op {transform.readonly})
      -> (!transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param) {
    %ins, %outs = transform.iree.match.cast_compatible_dag_from_root %op {
    ^bb0(%a0: tensor<64x5x256x8x1xf32>, %a1: tensor<64x32x256x8x1xf32>, %a2: tensor<64x5x32x8x8xf32>):
      %r = linalg.batch_mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 5, 4, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]>} ins(%a0, %a1 : tensor<64x5x256x8x1xf32>, tensor<64x32x256x8x1xf32>) outs(%a2 : tensor<64x5x32x8x8xf32>) -> tensor<64x5x32x8x8xf32>
    } : (!transform.any_op) -> (!transform.any_value, !transform.any_value)
    %config = transform.param.constant #iree_cpu.lowering_config<distribution = [1, 5, 16, 0, 0, 0, 0], vector_common_parallel = [1, 5, 2, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]> -> !transform.any_param
    %name = transform.param.constant "matmul_like_64x35x256x256_f32" -> !transform.any_param
    %target = transform.param.constant #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {cpu = "x86-64-v3", cpu_features = "+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave", data_layout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-i128:128-f80:128-n8:16:32:64-S128", debug_symbols = false, iree.encoding.resolver = #iree_cpu.cpu_encoding_resolver<>, max_stack_allocation_size = 131072 : i64, native_vector_size = 32 : i64, target_triple = "x86_64-unknown-unknown-eabi-elf", ukernels = "mmt4d,pack"}> -> !transform.any_param
    transform.yield %op, %config, %name, %target : !transform.any_op, !transform.any_param, !transform.any_param, !transform.any_param
  }
  transform.named_sequence @__dsa_tune(%root: !transform.any_op {transform.consumed}) {
    %res = transform.foreach_match in %root
        @match_matmul_like_302x512x3200_f32 -> @dsa_set_config,
        @match_matmul_like_64x540x64x64_f32 -> @dsa_set_config_and_ukernels,
        @match_matmul_like_64x12x512x512_f32 -> @dsa_set_config_and_ukernels,
        @match_matmul_like_64x140x128x128_f32 -> @dsa_set_config_and_ukernels,
        @match_matmul_like_64x35x256x256_f32 -> @dsa_set_config_and_ukernels
      : (!transform.any_op) -> !transform.any_op
    transform.yield
  }
}
