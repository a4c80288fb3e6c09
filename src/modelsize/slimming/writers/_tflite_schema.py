"""The TensorFlow Lite flatbuffer schema (``schema.fbs``, version 3d), as field lists.

Each table lists its fields in slot order, ``name:type``; the types are the scalar codes of
:mod:`struct` (``b B h H i I q Q f d``; ``?`` is a bool, one byte), ``str`` (a string), ``[x]``
(a vector of scalars, strings or tables; ``[B]/16`` is ``force_align: 16``), a table's name, or
``U:Union`` (a union: two slots, ``name_type`` and ``name``). Enums are written as their
underlying integer type. Deprecated fields keep their slot (and are copied when present).

Transcribed from TensorFlow/LiteRT's ``tflite/converter/schema/schema.fbs`` (the newest
revision: ``external_buffers``, ``BuiltinOptions2`` up to ``StablehloCaseOptions``);
``tests/formats/test_tflite.py`` checks every table and union against the schema TensorFlow's
own Python package generates (slot numbers and field widths).
"""

from __future__ import annotations

from modelsize.slimming.writers._flatbuffers import Schema


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


#: ``union BuiltinOptions``: member ``k`` has type id ``k + 1``.
BUILTIN_OPTIONS = _words(
    "Conv2DOptions DepthwiseConv2DOptions ConcatEmbeddingsOptions LSHProjectionOptions "
    "Pool2DOptions SVDFOptions RNNOptions FullyConnectedOptions SoftmaxOptions "
    "ConcatenationOptions AddOptions L2NormOptions LocalResponseNormalizationOptions LSTMOptions "
    "ResizeBilinearOptions CallOptions ReshapeOptions SkipGramOptions SpaceToDepthOptions "
    "EmbeddingLookupSparseOptions MulOptions PadOptions GatherOptions BatchToSpaceNDOptions "
    "SpaceToBatchNDOptions TransposeOptions ReducerOptions SubOptions DivOptions SqueezeOptions "
    "SequenceRNNOptions StridedSliceOptions ExpOptions TopKV2Options SplitOptions "
    "LogSoftmaxOptions CastOptions DequantizeOptions MaximumMinimumOptions ArgMaxOptions "
    "LessOptions NegOptions PadV2Options GreaterOptions GreaterEqualOptions LessEqualOptions "
    "SelectOptions SliceOptions TransposeConvOptions SparseToDenseOptions TileOptions "
    "ExpandDimsOptions EqualOptions NotEqualOptions ShapeOptions PowOptions ArgMinOptions "
    "FakeQuantOptions PackOptions LogicalOrOptions OneHotOptions LogicalAndOptions "
    "LogicalNotOptions UnpackOptions FloorDivOptions SquareOptions ZerosLikeOptions FillOptions "
    "BidirectionalSequenceLSTMOptions BidirectionalSequenceRNNOptions "
    "UnidirectionalSequenceLSTMOptions FloorModOptions RangeOptions "
    "ResizeNearestNeighborOptions LeakyReluOptions SquaredDifferenceOptions MirrorPadOptions "
    "AbsOptions SplitVOptions UniqueOptions ReverseV2Options AddNOptions GatherNdOptions "
    "CosOptions WhereOptions RankOptions ReverseSequenceOptions MatrixDiagOptions "
    "QuantizeOptions MatrixSetDiagOptions HardSwishOptions IfOptions WhileOptions "
    "DepthToSpaceOptions NonMaxSuppressionV4Options NonMaxSuppressionV5Options ScatterNdOptions "
    "SelectV2Options DensifyOptions SegmentSumOptions BatchMatMulOptions CumsumOptions "
    "CallOnceOptions BroadcastToOptions Rfft2dOptions Conv3DOptions HashtableOptions "
    "HashtableFindOptions HashtableImportOptions HashtableSizeOptions VarHandleOptions "
    "ReadVariableOptions AssignVariableOptions RandomOptions BucketizeOptions GeluOptions "
    "DynamicUpdateSliceOptions UnsortedSegmentProdOptions UnsortedSegmentMaxOptions "
    "UnsortedSegmentMinOptions UnsortedSegmentSumOptions ATan2Options SignOptions "
    "BitcastOptions BitwiseXorOptions RightShiftOptions"
)

#: ``union BuiltinOptions2``.
BUILTIN_OPTIONS_2 = _words(
    "StablehloConcatenateOptions StablehloBroadcastInDimOptions StablehloSliceOptions "
    "StablehloConvolutionOptions StablehloCustomCallOptions StablehloReduceOptions "
    "StablehloScatterOptions StablehloCompareOptions StablehloDynamicSliceOptions "
    "StablehloPadOptions StablehloIotaOptions StablehloDotGeneralOptions "
    "StablehloReduceWindowOptions StablehloSortOptions StablehloWhileOptions "
    "StablehloGatherOptions StablehloTransposeOptions DilateOptions "
    "StablehloRngBitGeneratorOptions ReduceWindowOptions StableHLOCompositeOptions "
    "StablehloShiftLeftOptions StablehloCaseOptions"
)

#: Option tables that hold no field at all.
_EMPTY = _words(
    "PadOptions PadV2Options SpaceToBatchNDOptions BatchToSpaceNDOptions TopKV2Options "
    "TransposeOptions ExpOptions CosOptions LogSoftmaxOptions DequantizeOptions "
    "MaximumMinimumOptions TileOptions GreaterOptions GreaterEqualOptions LessOptions "
    "LessEqualOptions NegOptions SelectOptions SliceOptions ExpandDimsOptions EqualOptions "
    "NotEqualOptions RankOptions PowOptions LogicalOrOptions AbsOptions HardSwishOptions "
    "LogicalAndOptions LogicalNotOptions FloorDivOptions SquareOptions ZerosLikeOptions "
    "FillOptions FloorModOptions RangeOptions SquaredDifferenceOptions ReverseV2Options "
    "AddNOptions GatherNdOptions WhereOptions MatrixDiagOptions QuantizeOptions "
    "MatrixSetDiagOptions NonMaxSuppressionV4Options NonMaxSuppressionV5Options "
    "ScatterNdOptions SelectV2Options DensifyOptions SegmentSumOptions BroadcastToOptions "
    "Rfft2dOptions HashtableFindOptions HashtableImportOptions HashtableSizeOptions "
    "ReadVariableOptions AssignVariableOptions DynamicUpdateSliceOptions "
    "UnsortedSegmentProdOptions UnsortedSegmentMaxOptions UnsortedSegmentSumOptions "
    "ATan2Options UnsortedSegmentMinOptions SignOptions BitcastOptions BitwiseXorOptions "
    "RightShiftOptions DilateOptions StablehloShiftLeftOptions"
)

_TABLES: dict[str, str] = {
    # -- the model ------------------------------------------------------------------------
    "Model": "version:I operator_codes:[OperatorCode] subgraphs:[SubGraph] description:str "
             "buffers:[Buffer] metadata_buffer:[i] metadata:[Metadata] "
             "signature_defs:[SignatureDef] external_buffer_groups:[ExternalBufferGroup] "
             "external_buffers:[ExternalBuffer]",
    "OperatorCode": "deprecated_builtin_code:b custom_code:str version:i builtin_code:i",
    "SubGraph": "tensors:[Tensor] inputs:[i] outputs:[i] operators:[Operator] name:str "
                "debug_metadata_index:i",
    "Tensor": "shape:[i] type:b buffer:I name:str quantization:QuantizationParameters "
              "is_variable:? sparsity:SparsityParameters shape_signature:[i] has_rank:? "
              "variant_tensors:[VariantSubType] external_buffer:I",
    "Operator": "opcode_index:I inputs:[i] outputs:[i] builtin_options:U:BuiltinOptions "
                "custom_options:[B] custom_options_format:b mutating_variable_inputs:[?] "
                "intermediates:[i] large_custom_options_offset:Q large_custom_options_size:Q "
                "builtin_options_2:U:BuiltinOptions2 debug_metadata_index:i",
    "Buffer": "data:[B]/16 offset:Q size:Q",
    "ExternalBufferGroup": "name:str",
    "ExternalBuffer": "id:I group:I offset:Q length:Q packing:str",
    "Metadata": "name:str buffer:I",
    "TensorMap": "name:str tensor_index:I",
    "SignatureDef": "inputs:[TensorMap] outputs:[TensorMap] signature_key:str "
                    "deprecated_tag:str subgraph_index:I",
    # -- tensors ----------------------------------------------------------------------------
    "CustomQuantization": "custom:[B]/16",
    "BlockwiseQuantization": "scales:i zero_points:i block_size:i",
    "MultiAxisQuantization": "scales:i zero_points:i block_size:i quantized_dimensions:[i]",
    "QuantizationParameters": "min:[f] max:[f] scale:[f] zero_point:[q] "
                              "details:U:QuantizationDetails quantized_dimension:i",
    "Int32Vector": "values:[i]",
    "Uint16Vector": "values:[H]/4",
    "Uint8Vector": "values:[B]/4",
    "DimensionMetadata": "format:b dense_size:i array_segments:U:SparseIndexVector "
                         "array_indices:U:SparseIndexVector",
    "SparsityParameters": "traversal_order:[i] block_map:[i] dim_metadata:[DimensionMetadata]",
    "VariantSubType": "shape:[i] type:b has_rank:?",
    # -- BuiltinOptions ---------------------------------------------------------------------
    "Conv2DOptions": "padding:b stride_w:i stride_h:i fused_activation_function:b "
                     "dilation_w_factor:i dilation_h_factor:i quantized_bias_type:b",
    "Conv3DOptions": "padding:b stride_d:i stride_w:i stride_h:i fused_activation_function:b "
                     "dilation_d_factor:i dilation_w_factor:i dilation_h_factor:i",
    "Pool2DOptions": "padding:b stride_w:i stride_h:i filter_width:i filter_height:i "
                     "fused_activation_function:b",
    "DepthwiseConv2DOptions": "padding:b stride_w:i stride_h:i depth_multiplier:i "
                              "fused_activation_function:b dilation_w_factor:i "
                              "dilation_h_factor:i",
    "ConcatEmbeddingsOptions": "num_channels:i num_columns_per_channel:[i] "
                               "embedding_dim_per_channel:[i]",
    "LSHProjectionOptions": "type:b",
    "SVDFOptions": "rank:i fused_activation_function:b asymmetric_quantize_inputs:?",
    "RNNOptions": "fused_activation_function:b asymmetric_quantize_inputs:?",
    "SequenceRNNOptions": "time_major:? fused_activation_function:b "
                          "asymmetric_quantize_inputs:?",
    "BidirectionalSequenceRNNOptions": "time_major:? fused_activation_function:b "
                                       "merge_outputs:? asymmetric_quantize_inputs:?",
    "FullyConnectedOptions": "fused_activation_function:b weights_format:b keep_num_dims:? "
                             "asymmetric_quantize_inputs:? quantized_bias_type:b",
    "SoftmaxOptions": "beta:f",
    "ConcatenationOptions": "axis:i fused_activation_function:b",
    "AddOptions": "fused_activation_function:b pot_scale_int16:?",
    "MulOptions": "fused_activation_function:b",
    "L2NormOptions": "fused_activation_function:b",
    "LocalResponseNormalizationOptions": "radius:i bias:f alpha:f beta:f",
    "LSTMOptions": "fused_activation_function:b cell_clip:f proj_clip:f kernel_type:b "
                   "asymmetric_quantize_inputs:?",
    "UnidirectionalSequenceLSTMOptions": "fused_activation_function:b cell_clip:f "
                                         "proj_clip:f time_major:? "
                                         "asymmetric_quantize_inputs:? "
                                         "diagonal_recurrent_tensors:?",
    "BidirectionalSequenceLSTMOptions": "fused_activation_function:b cell_clip:f proj_clip:f "
                                        "merge_outputs:? time_major:? "
                                        "asymmetric_quantize_inputs:?",
    "ResizeBilinearOptions": "new_height:i new_width:i align_corners:? half_pixel_centers:?",
    "ResizeNearestNeighborOptions": "align_corners:? half_pixel_centers:?",
    "CallOptions": "subgraph:I",
    "ReshapeOptions": "new_shape:[i]",
    "SkipGramOptions": "ngram_size:i max_skip_size:i include_all_ngrams:?",
    "SpaceToDepthOptions": "block_size:i",
    "DepthToSpaceOptions": "block_size:i",
    "SubOptions": "fused_activation_function:b pot_scale_int16:?",
    "DivOptions": "fused_activation_function:b",
    "EmbeddingLookupSparseOptions": "combiner:b",
    "GatherOptions": "axis:i batch_dims:i",
    "ReducerOptions": "keep_dims:?",
    "SqueezeOptions": "squeeze_dims:[i]",
    "SplitOptions": "num_splits:i",
    "SplitVOptions": "num_splits:i",
    "StridedSliceOptions": "begin_mask:i end_mask:i ellipsis_mask:i new_axis_mask:i "
                           "shrink_axis_mask:i offset:?",
    "CastOptions": "in_data_type:b out_data_type:b",
    "ArgMaxOptions": "output_type:b",
    "ArgMinOptions": "output_type:b",
    "TransposeConvOptions": "padding:b stride_w:i stride_h:i fused_activation_function:b "
                            "quantized_bias_type:b",
    "SparseToDenseOptions": "validate_indices:?",
    "ShapeOptions": "out_type:b",
    "FakeQuantOptions": "min:f max:f num_bits:i narrow_range:?",
    "PackOptions": "values_count:i axis:i",
    "OneHotOptions": "axis:i",
    "UnpackOptions": "num:i axis:i",
    "LeakyReluOptions": "alpha:f",
    "MirrorPadOptions": "mode:b",
    "UniqueOptions": "idx_out_type:b",
    "ReverseSequenceOptions": "seq_dim:i batch_dim:i",
    "IfOptions": "then_subgraph_index:i else_subgraph_index:i",
    "CallOnceOptions": "init_subgraph_index:i",
    "WhileOptions": "cond_subgraph_index:i body_subgraph_index:i",
    "BatchMatMulOptions": "adj_x:? adj_y:? asymmetric_quantize_inputs:?",
    "CumsumOptions": "exclusive:? reverse:?",
    "HashtableOptions": "table_id:i key_dtype:b value_dtype:b",
    "VarHandleOptions": "container:str shared_name:str",
    "RandomOptions": "seed:q seed2:q",
    "BucketizeOptions": "boundaries:[f]",
    "GeluOptions": "approximate:?",
    # -- BuiltinOptions2 --------------------------------------------------------------------
    "StablehloGatherOptions": "offset_dims:[q] collapsed_slice_dims:[q] start_index_map:[q] "
                              "index_vector_dim:q slice_sizes:[q] indices_are_sorted:?",
    "StablehloTransposeOptions": "permutation:[q]",
    "StablehloDotGeneralOptions": "lhs_batching_dimensions:[q] rhs_batching_dimensions:[q] "
                                  "lhs_contracting_dimensions:[q] "
                                  "rhs_contracting_dimensions:[q] precision_config:[I]",
    "StablehloReduceWindowOptions": "window_dimensions:[q] window_strides:[q] "
                                    "base_dilations:[q] window_dilations:[q] padding:[q] "
                                    "body_subgraph_index:i",
    "StablehloWhileOptions": "cond_subgraph_index:i body_subgraph_index:i",
    "StablehloSortOptions": "dimension:q is_stable:? comparator_subgraph_index:i",
    "StablehloConcatenateOptions": "dimension:q",
    "StablehloBroadcastInDimOptions": "broadcast_dimensions:[q]",
    "StablehloCompareOptions": "comparison_direction:I compare_type:I",
    "StablehloDynamicSliceOptions": "slice_sizes:[q]",
    "StablehloPadOptions": "edge_padding_low:[q] edge_padding_high:[q] interior_padding:[q]",
    "StablehloIotaOptions": "iota_dimension:q",
    "StablehloCustomCallOptions": "call_target_name:str has_side_effect:? backend_config:str "
                                  "api_version:i called_computations:[i] "
                                  "custom_attributes:[B]",
    "StablehloReduceOptions": "dimensions:[q] body_subgraph_index:i",
    "StablehloSliceOptions": "start_indices:[q] limit_indices:[q] strides:[q]",
    "StablehloConvolutionOptions": "window_strides:[q] padding:[q] lhs_dilation:[q] "
                                   "rhs_dilation:[q] window_reversal:[?] "
                                   "input_batch_dimension:q input_feature_dimension:q "
                                   "input_spatial_dimensions:[q] "
                                   "kernel_input_feature_dimension:q "
                                   "kernel_output_feature_dimension:q "
                                   "kernel_spatial_dimensions:[q] output_batch_dimension:q "
                                   "output_feature_dimension:q output_spatial_dimensions:[q] "
                                   "feature_group_count:q batch_group_count:q "
                                   "precision_config:[I]",
    "StablehloScatterOptions": "indices_are_sorted:? update_window_dims:[q] "
                               "inserted_window_dims:[q] scatter_dims_to_operand_dims:[q] "
                               "index_vector_dim:q unique_indices:? "
                               "update_computation_subgraph_index:i",
    "StablehloCaseOptions": "branch_subgraph_indices:[i]",
    "StablehloRngBitGeneratorOptions": "algorithm:b",
    "ReduceWindowOptions": "reduce_function:i",
    "StableHLOCompositeOptions": "name:str decomposition_subgraph_index:i "
                                 "composite_attributes:[B] composite_attributes_format:b "
                                 "version:i",
}

SCHEMA = Schema.parse(
    {**_TABLES, **dict.fromkeys(_EMPTY, "")},
    {
        "BuiltinOptions": BUILTIN_OPTIONS,
        "BuiltinOptions2": BUILTIN_OPTIONS_2,
        "QuantizationDetails": ("CustomQuantization", "BlockwiseQuantization",
                                "MultiAxisQuantization"),
        "SparseIndexVector": ("Int32Vector", "Uint16Vector", "Uint8Vector"),
    },
    root="Model",
    identifier=b"TFL3",
)
