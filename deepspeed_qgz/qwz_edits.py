# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The quantized weights (qwZ) for any partition size: the edits to ZeRO-3's parameter partitioning
(deepspeed/runtime/zero/partition_parameters.py). Every path that quantizes weights goes through
CUDAQuantizer, which now pads each parameter's partition to whole groups of one size
(deepspeed/runtime/zero/quantized_weights.py): the coalesced and the one-by-one all-gathers,
hpZ's secondary partitions, and non-trainable weights kept quantized (which are now quantized
once their partition holds its values). The gathered buckets are narrowed back to the
parameters' partitions; nothing ZeRO-3 keeps or hands on changes."""

import textwrap

PATH = "deepspeed/runtime/zero/partition_parameters.py"


def _at_depth(pair, depth):
    return tuple(textwrap.indent(text, " " * depth) for text in pair)


# A parameter kept quantized on a single rank: its padded codes narrowed to its values. The same
# statement stands at two depths of the all-gather.
KEPT_QUANTIZED = ('''if hasattr(param.ds_tensor, "ds_quant_scale"):
    param.data = Init.quantizer_module.dequantize(param.ds_tensor.data,
                                                  param.ds_tensor.ds_quant_scale,
                                                  dtype=param.dtype).to(
                                                      device=get_accelerator().current_device_name(),
                                                      non_blocking=True).view(param.ds_shape)
''', '''if hasattr(param.ds_tensor, "ds_quant_scale"):
    param.data = Init.quantizer_module.dequantize(param.ds_tensor.data,
                                                  param.ds_tensor.ds_quant_scale,
                                                  dtype=param.dtype).narrow(0, 0, param.ds_numel).to(
                                                      device=get_accelerator().current_device_name(),
                                                      non_blocking=True).view(param.ds_shape)
''')

# (old, new) pairs, each old text found exactly once in the file.
REPLACEMENTS = (
    # The quantizer: partitions padded to whole groups of one size, one kernel per bucket.
    ('''class CUDAQuantizer:
    async_flag = True
    target_group_size = 8000  # the optimal size is 4k, so we set the target to be below 8k
    group_size_cache = dict()
    quantizer_cuda_module = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = deepspeed.ops.op_builder.QuantizerBuilder().load()

    def quantize(self, param, groups=None):
        if groups is None:
            try:
                groups = self.group_size_cache[param.numel()]
            except KeyError:
                groups = math.ceil(param.numel() / self.target_group_size)
                while groups < param.numel():
                    if param.numel() % (8 * groups) == 0:
                        break
                    groups += 1
                while True:
                    if param.numel() % (8 * groups * 2) == 0 and param.numel(
                    ) / groups > self.target_group_size:  #hard limit of 16k group_size
                        groups *= 2
                    else:
                        break
                assert (
                    param.numel() % (8 * groups) == 0
                ), f"Qantized weight requires the number of weights be a multiple of 8. Yet {param.numel()} cannot be divided by 8*{groups}"
                assert (param.numel() / groups < 16000), f"{param.numel()} / {groups} is larger than 16k"
                assert param.numel(
                ) > groups, f"Adaptive grouping algorithm cannot find a group size for input tensor of size {param.numel()}"
                self.group_size_cache[param.numel()] = groups
        # The CUDA kernel reads its input through a __half* and always writes fp16 back out, so a bf16
        # parameter would be reinterpreted bit-for-bit and silently corrupted. Convert on the way in and
        # let the caller ask for its own dtype back on the way out.
        param = param.to(get_accelerator().device_name(), dtype=torch.half)
        return self.quantizer_cuda_module.quantize(param, groups, 8, self.quantizer_cuda_module.Symmetric)

    def dequantize(self, quantized_param, scale, dtype=None):
        dequantized = self.quantizer_cuda_module.dequantize(quantized_param, scale, scale.numel(), 8,
                                                            self.quantizer_cuda_module.Symmetric)
        if dtype is not None and dequantized.dtype != dtype:
            dequantized = dequantized.to(dtype)
        return dequantized
''', '''class CUDAQuantizer:
    """ZeRO++'s weight quantizer (qwZ) on the accelerator's QuantizerBuilder op: a rank's partitions
    padded to whole groups of one size, one kernel per bucket (quantized_weights.py)."""
    async_flag = True
    quantizer_cuda_module = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            from deepspeed.ops.quantizer.qgz_contract import ContractCheckedQuantizer
            CUDAQuantizer.quantizer_cuda_module = ContractCheckedQuantizer(
                deepspeed.ops.op_builder.QuantizerBuilder().load())

    @staticmethod
    def layout(numels):
        """The padded layout of a rank's partitions of `numels` values."""
        from deepspeed.runtime.zero.quantized_weights import quantized_weight_layout
        return quantized_weight_layout(tuple(numels))

    def quantize(self, partitions):
        """A rank's partition of a parameter, or its partitions of several (a list), as one padded
        partition of int8 codes and its fp32 scales."""
        from deepspeed.runtime.zero.quantized_weights import quantize_weights
        partitions = [partitions] if torch.is_tensor(partitions) else list(partitions)
        device = get_accelerator().current_device_name()
        return quantize_weights(self.quantizer_cuda_module, [p.to(device) for p in partitions],
                                self.layout(p.numel() for p in partitions))

    def dequantize(self, quantized_param, scale, dtype=None):
        """Codes of whole groups (a padded partition, or a gathered bucket of them) as `dtype`
        values (fp16 by default), padding included."""
        from deepspeed.runtime.zero.quantized_weights import dequantize_weights
        return dequantize_weights(self.quantizer_cuda_module, quantized_param, scale, dtype or torch.half)

    @staticmethod
    def gathered_param(values, layout, index, param, world_size):
        """Parameter `param` (the `index`th of a gathered bucket laid out by `layout`) from every
        rank's padded partition in `values`, as one tensor of its shape."""
        partition = layout.numels[index]
        parts = [
            layout.gathered_partition(values, index, rank, min(partition, param.ds_numel - rank * partition))
            for rank in range(world_size) if rank * partition < param.ds_numel
        ]
        return instrument_w_nvtx(torch.cat)(parts).view(param.ds_shape)
'''),
    *(_at_depth(KEPT_QUANTIZED, depth) for depth in (8, 12)),
    # The one-by-one quantized all-gather: the whole gathered buffer dequantized, then narrowed.
    ('''            self.__param.data = self.__quantization.backend.dequantize(self.__quantization.quantized_param,
                                                                       self.__quantization.scale_buffer,
                                                                       dtype=self.__param.dtype).to(
                                                                           self.__param.device)
''', '''            values = self.__quantization.backend.dequantize(self.__quantization.quantized_param,
                                                            self.__quantization.scale_buffer,
                                                            dtype=self.__param.dtype)
            self.__param.data = self.__quantization.backend.gathered_param(
                values, self.__quantization.layout, 0, self.__param,
                self.__quantization.world_size).to(self.__param.device)
'''),
    # The coalesced quantized all-gather: per-rank padded partitions, each parameter at its offset.
    ('''            flat_tensor = self.quantization.backend.dequantize(
                self.quantization.quantized_param, self.quantization.scale_buffer).to(self.params[0].device)
''', '''            dtypes = {p.dtype for p in self.params}
            flat_tensor = self.quantization.backend.dequantize(
                self.quantization.quantized_param,
                self.quantization.scale_buffer,
                dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32).to(self.params[0].device)
'''),
    ('''        param_offset = 0
        for param in self.params:
            assert param.ds_status == ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
''', '''        param_offset = 0
        for index, param in enumerate(self.params):
            assert param.ds_status == ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
            if self.quantization:
                param_offset = self.quantization.layout.offsets[index]
'''),
    ('''            param.data = instrument_w_nvtx(torch.cat)(partitions).view(param.ds_shape).to(param.ds_tensor.dtype)
''', '''            param.data = instrument_w_nvtx(torch.cat)(partitions).view(param.ds_shape).to(
                param.dtype if hasattr(param.ds_tensor, "ds_quant_scale") else param.ds_tensor.dtype)
'''),
    ('''                param_ds_tensor = param.ds_secondary_tensor if use_secondary_tensor else param.ds_tensor
''', '''                param_ds_tensor = param.ds_secondary_tensor if use_secondary_tensor else param.ds_tensor
                if quantize:
                    layout = self.quantizer_module.layout([param_ds_tensor.ds_numel])
                    buffer_size = layout.padded_partition * world_size
'''),
    ('''                    quant_info = QuantizationInfo()
                    quant_info.quantized_param = param_buffer.narrow(0, 0, param.ds_numel).view(param.ds_shape).to(
                        param.device)
                    quant_info.backend = self.quantizer_module
''', '''                    quant_info = QuantizationInfo()
                    quant_info.quantized_param = param_buffer
                    quant_info.layout = layout
                    quant_info.world_size = world_size
                    quant_info.backend = self.quantizer_module
'''),
    ('''                else:
                    partition_sz = sum(p.ds_tensor.ds_numel for p in params)

                    if use_secondary_tensor:
                        partition_sz = sum(p.ds_tensor.ds_numel * p.ds_secondary_tensor_num_of_groups for p in params)

                    flat_tensor = torch.empty(partition_sz * world_size,
                                              dtype=torch.int8,
                                              device=get_accelerator().current_device_name(),
                                              requires_grad=False)

                    if use_secondary_tensor:
                        if hasattr(params[0].ds_secondary_tensor, "ds_quant_scale"):
                            quantized_param = instrument_w_nvtx(torch.cat)([
                                p.ds_secondary_tensor.data.to(get_accelerator().current_device_name()) for p in params
                            ])
                            scales = instrument_w_nvtx(torch.cat)([
                                p.ds_secondary_tensor.ds_quant_scale.to(get_accelerator().current_device_name())
                                for p in params
                            ])
                        else:
                            quantized_param, scales = self.quantizer_module.quantize(
                                instrument_w_nvtx(torch.cat)([
                                    p.ds_secondary_tensor.to(get_accelerator().current_device_name()) for p in params
                                ]))
                    else:
                        if hasattr(params[0].ds_tensor, "ds_quant_scale"):
                            quantized_param = instrument_w_nvtx(torch.cat)(
                                [p.ds_tensor.data.to(get_accelerator().current_device_name()) for p in params])
                            scales = instrument_w_nvtx(torch.cat)([
                                p.ds_tensor.ds_quant_scale.to(get_accelerator().current_device_name()) for p in params
                            ])
                        else:
                            quantized_param, scales = self.quantizer_module.quantize(
                                instrument_w_nvtx(torch.cat)(
                                    [p.ds_tensor.to(get_accelerator().current_device_name()) for p in params]))
''', '''                else:
                    tensors = [p.ds_secondary_tensor if use_secondary_tensor else p.ds_tensor for p in params]
                    layout = self.quantizer_module.layout(t.ds_numel for t in tensors)
                    partition_sz = layout.padded_partition

                    flat_tensor = torch.empty(partition_sz * world_size,
                                              dtype=torch.int8,
                                              device=get_accelerator().current_device_name(),
                                              requires_grad=False)

                    if hasattr(tensors[0], "ds_quant_scale"):
                        # kept quantized, each padded to whole groups of the one size: their
                        # concatenation is the bucket's padded partition
                        device = get_accelerator().current_device_name()
                        quantized_param = instrument_w_nvtx(torch.cat)([t.data.to(device) for t in tensors])
                        scales = instrument_w_nvtx(torch.cat)([t.ds_quant_scale.to(device) for t in tensors])
                    else:
                        quantized_param, scales = self.quantizer_module.quantize(tensors)
'''),
    ('''                    quant_info.partition_sz = partition_sz
                    quant_info.world_size = world_size
''', '''                    quant_info.partition_sz = partition_sz
                    quant_info.layout = layout
                    quant_info.world_size = world_size
'''),
    # The padding past a parameter's end in the last partitions, where qwZ quantizes it with the
    # values: zeros, not stale memory. Without qwZ it is left as upstream leaves it.
    ("""                        param.ds_tensor.narrow(0, 0,
                                               elems_to_copy).copy_(one_dim_param.narrow(0, start, elems_to_copy))
""", """                        param.ds_tensor.narrow(0, 0,
                                               elems_to_copy).copy_(one_dim_param.narrow(0, start, elems_to_copy))
                if self.quantized_weights or self.quantized_nontrainable_weights:
                    with torch.no_grad():
                        copied = max(0, param.ds_numel - start)
                        param.ds_tensor.narrow(0, copied, partition_size - copied).zero_()
"""),
    # Non-trainable weights kept quantized: quantized once the partition holds the parameter's
    # values (not before, when it is still uninitialized memory).
    ('''                    partitioned_tensor = torch.empty(partition_size, dtype=param.dtype, device=device)
                    # quantize the tensor if it's not trainable
                    if not param.requires_grad and self.quantized_nontrainable_weights:
                        partitioned_tensor, partitioned_tensor.ds_quant_scale = self.quantizer_module.quantize(
                            partitioned_tensor)
''', '''                    partitioned_tensor = torch.empty(partition_size, dtype=param.dtype, device=device)
'''),
    ('''            #print(f"Remote device {self.remote_device}")

            #param.ds_tensor = partitioned_tensor
''', '''            # quantized only after the copy: the scales must come from the values
            if quantize:
                param.ds_tensor = _quantized_partition(self.quantizer_module, param.ds_tensor)

            #print(f"Remote device {self.remote_device}")

            #param.ds_tensor = partitioned_tensor
'''),
    ('''                # quantize the tensor if it's not trainable
                if not param.requires_grad and self.quantized_nontrainable_weights:
                    secondary_partitioned_tensor, secondary_partitioned_tensor.ds_quant_scale = self.quantizer_module.quantize(
                        secondary_partitioned_tensor)
                secondary_partitioned_tensor.requires_grad = False
''', '''                secondary_partitioned_tensor.requires_grad = False
'''),
    ('''                if sec_numel > 0:
                    param.ds_secondary_tensor.narrow(0, 0, sec_numel).copy_(
                        one_dim_param.narrow(0, secondary_start, sec_numel))
''', '''                if sec_numel > 0:
                    param.ds_secondary_tensor.narrow(0, 0, sec_numel).copy_(
                        one_dim_param.narrow(0, secondary_start, sec_numel))
            # as in _partition_param, quantized only after the copy
            if quantize:
                param.ds_secondary_tensor = _quantized_partition(self.quantizer_module, param.ds_secondary_tensor)
'''),
    # Which partitions are kept quantized (the rules of the series' 0002 and 0006): a new one if its
    # parameter is frozen; an updated one (a frozen weight changed in place) keeps its format, its
    # values copied into floats first (into the int8 codes they would be truncated).
    ('''                param.ds_numel_aligned = tensor_size

            start = partition_size * self._partition_rank(param)
''', '''                param.ds_numel_aligned = tensor_size
                # an NVMe partition is swapped out from its buffer, which holds the parameter's dtype
                quantize = (not param.requires_grad and self.quantized_nontrainable_weights
                            and final_location != OffloadDeviceEnum.nvme)
            else:
                quantize = hasattr(param.ds_tensor, "ds_quant_scale")
                if quantize:
                    param.ds_tensor = _float_partition(param.ds_tensor, partition_size, param.dtype)

            start = partition_size * self._partition_rank(param)
'''),
    ('''                param.ds_secondary_tensor.final_location = final_location

            #use rank in group for secondary tensor
''', '''                param.ds_secondary_tensor.final_location = final_location
                # The fetch takes the format from the primary: once it exists, follow it (a parameter
                # frozen after its primary was made keeps a plain one). The first time, _partition makes
                # the secondary before the primary: the primary's rule.
                if getattr(param, "ds_tensor", None) is not None:
                    quantize = hasattr(param.ds_tensor, "ds_quant_scale")
                else:
                    quantize = not param.requires_grad and self.quantized_nontrainable_weights
            else:
                quantize = hasattr(param.ds_secondary_tensor, "ds_quant_scale")
                if quantize:
                    param.ds_secondary_tensor = _float_partition(param.ds_secondary_tensor, secondary_partition_size,
                                                                 param.dtype)

            #use rank in group for secondary tensor
'''),
    ('''class QuantizationInfo:
    # a placeholder object to store all quant related vars used in handles
    def __init__(self) -> None:
        self.quantized_param = None
        self.backend = None
        self.quant_handle = None
        self.scale_buffer = None
''', '''class QuantizationInfo:
    # a placeholder object to store all quant related vars used in handles
    def __init__(self) -> None:
        self.quantized_param = None
        self.backend = None
        self.quant_handle = None
        self.scale_buffer = None
        self.layout = None  # the padded layout of each rank's part of quantized_param
        self.world_size = None


def _quantized_partition(quantizer, partition):
    """`partition` (a parameter's partition holding its values) as the int8 codes of its padded
    partition, carrying the scales and the partition's attributes."""
    codes, codes.ds_quant_scale = quantizer.quantize(partition)
    for attribute in ("ds_numel", "status", "final_location"):
        if hasattr(partition, attribute):
            setattr(codes, attribute, getattr(partition, attribute))
    codes.requires_grad = False
    return codes


def _float_partition(codes, size, dtype):
    """An empty partition of `size` values of `dtype` in place of one kept quantized (`codes`),
    carrying its attributes: an update's values are copied into it, then quantized."""
    partition = codes.new_empty(size, dtype=dtype)  # not torch.empty, which zero.Init recasts
    for attribute in ("ds_numel", "status", "final_location"):
        if hasattr(codes, attribute):
            setattr(partition, attribute, getattr(codes, attribute))
    partition.requires_grad = False
    return partition
'''),
    # The blocking coalesced gather of parameters kept quantized.
    ('''        for param in param_list:
            partition_sizes.append(param.ds_tensor.ds_numel)
            local_tensors.append(param.ds_tensor.to(get_accelerator().device_name()))
''', '''        for param in param_list:
            # kept quantized: its codes are padded to whole groups
            partition_sizes.append(param.ds_tensor.numel() if quantize else param.ds_tensor.ds_numel)
            local_tensors.append(param.ds_tensor.to(get_accelerator().device_name()))
'''),
    ('''            if quantize:
                gathered_tensor = self.quantizer_module.dequantize(gathered_tensor,
                                                                   allgather_quantize_scale[i],
                                                                   dtype=param.dtype)
            param.data = gathered_tensor.narrow(0, 0, param.ds_numel).view(param.ds_shape).data
''', '''            if quantize:
                values = self.quantizer_module.dequantize(gathered_tensor,
                                                          allgather_quantize_scale[i],
                                                          dtype=param.dtype)
                param.data = self.quantizer_module.gathered_param(
                    values, self.quantizer_module.layout([param.ds_tensor.ds_numel]), 0, param,
                    self._partition_world_size(param)).data
                continue
            param.data = gathered_tensor.narrow(0, 0, param.ds_numel).view(param.ds_shape).data
'''),
    # The blocking one-by-one gather of a parameter kept quantized (GatheredParameters of one
    # parameter): its codes are padded to whole groups.
    ('''        for param in param_list:
            partition_size = param.ds_tensor.ds_numel
            partition_world_size = self._partition_world_size(param)
            partition_rank = self._partition_rank(param)
''', '''        for param in param_list:
            partition_size = param.ds_tensor.ds_numel
            if hasattr(param.ds_tensor, "ds_quant_scale"):
                partition_size = param.ds_tensor.numel()
            partition_world_size = self._partition_world_size(param)
            partition_rank = self._partition_rank(param)
'''),
    ('''                flat_tensor = self.quantizer_module.dequantize(flat_tensor, flat_scale_tensor, dtype=param.dtype)

            param.data = flat_tensor.narrow(0, 0, param.ds_numel).view(param.ds_shape)
''', '''                values = self.quantizer_module.dequantize(flat_tensor, flat_scale_tensor, dtype=param.dtype)
                param.data = self.quantizer_module.gathered_param(
                    values, self.quantizer_module.layout([param.ds_tensor.ds_numel]), 0, param,
                    partition_world_size).data
                continue

            param.data = flat_tensor.narrow(0, 0, param.ds_numel).view(param.ds_shape)
'''),
)
