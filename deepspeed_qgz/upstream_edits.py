# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch's changes to files DeepSpeed already has and the patch does not replace: small edits,
each an exact piece of upstream text and what it becomes. The overlay applies them to the installed
DeepSpeed's source when it imports those modules; ``python -m deepspeed_qgz diff`` turns them into
the pull request's hunks. An edit whose text is not found the expected number of times raises,
so a DeepSpeed release that moved the code fails loudly instead of loading half a patch."""

from dataclasses import dataclass
from typing import Tuple

from .series import series_edits


@dataclass(frozen=True)
class Edit:
    path: str  # in DeepSpeed's source tree
    old: str
    new: str
    count: int = 1  # occurrences of `old` expected (all are replaced)
    when: str = ""  # if set, the edit applies only to a file holding this text (some supported trees lack it)
    # (old, new) pairs: the same change where a supported tree has `old` in another form; exactly one
    # form may occur in a file, `count` times
    variants: Tuple[Tuple[str, str], ...] = ()

    @property
    def in_package(self) -> bool:
        """Whether the file ships in an installed deepspeed package (and so in the overlay);
        documentation exists only in DeepSpeed's git tree."""
        return not self.path.startswith(TREE_ONLY)


# Paths of DeepSpeed's git tree that its installed package does not have.
TREE_ONLY = ("docs/", "tests/", "requirements/")


class EditError(RuntimeError):
    pass


def _stage3_arguments(indent: str) -> str:
    """Stage 3's arguments to all_to_all_quant_reduce, one per line at `indent`, unclosed."""
    return ",\n".join(indent + argument for argument in (
        "full_grads_for_rank",
        "self.all2all_process_group",
        "group_size=self.zero_quantized_gradients_group_size",
        "intra_node_bits=self.zero_quantized_gradients_intra_node_bits",
        "fused=self.zero_quantized_gradients_fused",
    ))


_LOCO_CHOICE = " " * 40 + "if self.zeropp_loco_param is not None else all_to_all_quant_reduce(\n"

# ZeRO's config field the new keys follow, and those keys; trees from before LoCo's removal (DeepSpeed
# PR #8534) have LoCo's field right after it, without a blank line
_GRADIENTS_FIELD = ('    zero_quantized_gradients: bool = False\n'
                    '    """\n'
                    '    Boolean indicating whether to use quantized zero gradients\n'
                    '    for efficient all_2_all_reduce comm\n'
                    '    """\n')
_NEW_GRADIENTS_FIELDS = (
    '\n'
    '    zero_quantized_gradients_group_size: int = 136\n'
    '    """\n'
    '    Largest quantization group of the quantized gradients (zero_quantized_gradients),\n'
    '    in values: a multiple of 8 from 136 to 40960. Smaller groups follow the\n'
    '    gradients more closely and send more scale bytes (4 per group).\n'
    '    """\n'
    '\n'
    '    zero_quantized_gradients_intra_node_bits: int = 4\n'
    '    """\n'
    '    Bits per value of the quantized gradients (zero_quantized_gradients, on more\n'
    '    than one node) that the ranks of a node exchange; between nodes they are 4 bits.\n'
    '    8 doubles the bytes sent inside the node and shrinks the error of the node\'s sum\n'
    '    (with one device per node, a sum of one copy, it does not).\n'
    '    """\n'
    '\n'
    '    @field_validator("zero_quantized_gradients_group_size")\n'
    '    @classmethod\n'
    '    def quantized_gradients_group_size_valid(cls, value):\n'
    '        from deepspeed.runtime.comm.quantized_layout import resolve_group_size\n'
    '        return resolve_group_size(value, "zero_quantized_gradients_group_size")\n'
    '\n'
    '    @field_validator("zero_quantized_gradients_intra_node_bits")\n'
    '    @classmethod\n'
    '    def quantized_gradients_intra_node_bits_valid(cls, value):\n'
    '        from deepspeed.runtime.comm.quantized_layout import resolve_intra_node_bits\n'
    '        return resolve_intra_node_bits(value, "zero_quantized_gradients_intra_node_bits")\n'
    '\n'
    '    zero_quantized_gradients_fused: Union[bool, str] = "auto"\n'
    '    """\n'
    '    Run the quantized gradients\' (zero_quantized_gradients) three stages as fused\n'
    '    Triton kernels, one launch each, with the same results bit for bit as\n'
    '    DeepSpeed\'s quantizer kernels: true, false, or "auto", where each GPU checks\n'
    '    the fused kernels\' bits against the reference at the first call and uses them\n'
    '    where they match and are faster (every rank agreeing). true needs Triton and a\n'
    '    CUDA accelerator.\n'
    '    """\n'
    '\n'
    '    @field_validator("zero_quantized_gradients_fused", mode="before")\n'
    '    @classmethod\n'
    '    def quantized_gradients_fused_valid(cls, value):\n'
    '        from deepspeed.runtime.comm.quantized_fused_choice import resolve_fused\n'
    '        value = resolve_fused(value, "zero_quantized_gradients_fused")\n'
    '        if value is True:\n'
    '            from deepspeed.accelerator import get_accelerator\n'
    '            from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason\n'
    '            reason = fused_unavailable_reason(get_accelerator().device_name())\n'
    '            if reason is not None:\n'
    '                raise ValueError(f"zero_quantized_gradients_fused true cannot run here: {reason}")\n'
    '        return value\n')
_LOCO_FIELD = "    zeropp_loco_param: Optional[Dict[str, Any]] = None\n"

EDITS: Tuple[Edit, ...] = (
    # The CPU accelerator's op registry hands out the CPU quantizer for "QuantizerBuilder", so that
    # deepspeed.ops.op_builder.QuantizerBuilder, create_op_builder, __compatible_ops__ and ds_report
    # all see it (they fall back to NotImplementedBuilder otherwise).
    Edit("op_builder/cpu/__init__.py", "from .pin_memory import PinMemoryBuilder\n",
         "from .pin_memory import PinMemoryBuilder\nfrom .quantizer import QuantizerBuilder\n"),
    Edit("accelerator/cpu_accelerator.py",
         "PinMemoryBuilder, NotImplementedBuilder",
         "PinMemoryBuilder, QuantizerBuilder, NotImplementedBuilder",
         count=2),
    Edit(
        "accelerator/cpu_accelerator.py", '        elif class_name == "PinMemoryBuilder":\n'
        '            return PinMemoryBuilder\n', '        elif class_name == "PinMemoryBuilder":\n'
        '            return PinMemoryBuilder\n'
        '        elif class_name == "QuantizerBuilder":\n'
        '            return QuantizerBuilder\n'),

    # ZeRO config keys for the quantized gradient reduce-scatter: the model validates them (the
    # rules live in deepspeed/runtime/comm/quantized_layout.py), the engine hands them to stage 3,
    # stage 3 to all_to_all_quant_reduce.
    # (DeepSpeed's tree from before 0.19.8, edaa722, imports two more names from typing)
    Edit("deepspeed/runtime/zero/config.py",
         "from typing import Optional\n",
         "from typing import Optional, Union\n",
         variants=(("from typing import Optional, Dict, Any\n", "from typing import Optional, Dict, Any, Union\n"), )),
    Edit("deepspeed/runtime/zero/config.py", "from pydantic import Field, model_validator\n",
         "from pydantic import Field, field_validator, model_validator\n"),
    Edit(
        "deepspeed/runtime/zero/config.py", '    "zero_quantized_gradients": [true|false],\n',
        '    "zero_quantized_gradients": [true|false],\n'
        '    "zero_quantized_gradients_group_size": 136,\n'
        '    "zero_quantized_gradients_intra_node_bits": [4|8],\n'
        '    "zero_quantized_gradients_fused": [true|false|"auto"],\n'),
    Edit("deepspeed/runtime/zero/config.py",
         _GRADIENTS_FIELD + "\n",
         _GRADIENTS_FIELD + _NEW_GRADIENTS_FIELDS + "\n",
         variants=((_GRADIENTS_FIELD + _LOCO_FIELD, _GRADIENTS_FIELD + _NEW_GRADIENTS_FIELDS + "\n" + _LOCO_FIELD), )),
    Edit(
        "deepspeed/runtime/engine.py",
        "                    log_trace_cache_warnings=self.zero_log_trace_cache_warnings(),\n"
        "                    enable_sanity_checks=self.is_sanity_checks_enabled(),\n",
        "                    log_trace_cache_warnings=self.zero_log_trace_cache_warnings(),\n"
        "                    zero_quantized_gradients_group_size=self.zero_quantized_gradients_group_size(),\n"
        "                    zero_quantized_gradients_intra_node_bits=self.zero_quantized_gradients_intra_node_bits(),\n"
        "                    zero_quantized_gradients_fused=self.zero_quantized_gradients_fused(),\n"
        "                    enable_sanity_checks=self.is_sanity_checks_enabled(),\n"),
    Edit(
        "deepspeed/runtime/engine.py", "    def zero_quantized_gradients(self):\n"
        "        return self._config.zero_config.zero_quantized_gradients\n",
        "    def zero_quantized_gradients(self):\n"
        "        return self._config.zero_config.zero_quantized_gradients\n"
        "\n"
        "    def zero_quantized_gradients_group_size(self):\n"
        "        return self._config.zero_config.zero_quantized_gradients_group_size\n"
        "\n"
        "    def zero_quantized_gradients_intra_node_bits(self):\n"
        "        return self._config.zero_config.zero_quantized_gradients_intra_node_bits\n"
        "\n"
        "    def zero_quantized_gradients_fused(self):\n"
        "        return self._config.zero_config.zero_quantized_gradients_fused\n"),
    Edit(
        "deepspeed/runtime/zero/stage3.py", "        zero_quantized_nontrainable_weights=False,\n",
        "        zero_quantized_nontrainable_weights=False,\n"
        "        zero_quantized_gradients_group_size=None,\n"
        "        zero_quantized_gradients_intra_node_bits=None,\n"
        "        zero_quantized_gradients_fused=\"auto\",\n"),
    Edit(
        "deepspeed/runtime/zero/stage3.py", "        self.all2all_process_group = all2all_process_group\n",
        "        self.all2all_process_group = all2all_process_group\n"
        "        self.zero_quantized_gradients_group_size = zero_quantized_gradients_group_size\n"
        "        self.zero_quantized_gradients_intra_node_bits = zero_quantized_gradients_intra_node_bits\n"
        "        self.zero_quantized_gradients_fused = zero_quantized_gradients_fused\n"),
    Edit(
        "deepspeed/runtime/zero/stage3.py",
        "            grad_partitions_for_rank = all_to_all_quant_reduce(full_grads_for_rank, self.all2all_process_group)\n",
        "            grad_partitions_for_rank = all_to_all_quant_reduce(\n" + _stage3_arguments(" " * 16) + ")\n",
        # trees from before LoCo's removal (DeepSpeed PR #8534) choose between LoCo and qgZ here
        variants=((_LOCO_CHOICE + " " * 44 + "full_grads_for_rank, self.all2all_process_group))\n",
                   _LOCO_CHOICE + _stage3_arguments(" " * 44) + "))\n"), )),
    Edit(
        "docs/_pages/config-json.md", '    "zero_quantized_gradients": [true|false],\n',
        '    "zero_quantized_gradients": [true|false],\n'
        '    "zero_quantized_gradients_group_size": 136,\n'
        '    "zero_quantized_gradients_intra_node_bits": [4|8],\n'
        '    "zero_quantized_gradients_fused": [true|false|"auto"],\n'),
    Edit(
        "docs/_pages/config-json.md",
        "|Boolean indicating whether to enable communication efficient quantized gradients of ZeRO++. | `False`   |\n",
        "|Boolean indicating whether to enable communication efficient quantized gradients of ZeRO++. | `False`   |\n"
        "\n"
        "***zero_quantized_gradients_group_size***: [integer]\n"
        "\n"
        "| Description | Default |\n"
        "| ----------- | ------- |\n"
        "| Largest quantization group of ZeRO++'s quantized gradients, in values: a multiple of 8 from 136 to "
        "40960. Each rank's share of each gradient is padded to whole groups of one size per reduce-scatter call, "
        "the size sending the fewest bytes up to this one; every group carries a 4-byte scale. Smaller groups "
        "follow the gradients more closely. | `136` |\n"
        "\n"
        "***zero_quantized_gradients_intra_node_bits***: [integer]\n"
        "\n"
        "| Description | Default |\n"
        "| ----------- | ------- |\n"
        "| Precision of ZeRO++'s quantized gradients exchanged between the ranks of a node: `8` or `4` bits. The "
        "node sums exchanged between nodes are always 4 bits, so 8 doubles the bytes sent inside the node, "
        "not across nodes, and lowers the gradients' quantization error. | `8` |\n"
        "\n"
        "***zero_quantized_gradients_fused***: [boolean or \"auto\"]\n"
        "\n"
        "| Description | Default |\n"
        "| ----------- | ------- |\n"
        "| Run ZeRO++'s quantized gradient reduce-scatter as three fused Triton kernels, one launch per stage, "
        "which read the gradients where they lie and give the same results bit for bit as DeepSpeed's quantizer "
        "kernels, with less memory traffic. `\"auto\"`: at the first call, each GPU checks the fused kernels' "
        "bits against the reference quantizer and times one call of each path; the fused kernels run where "
        "their bits match and they are faster, on every rank or none, and rank 0 logs the choice. `true` needs "
        "Triton (CUDA builds of PyTorch ship it) and a CUDA accelerator; `deepspeed.initialize` says why when it "
        "cannot run. | `\"auto\"` |\n"),
    # DeepSpeed's LoCo test takes any compatible QuantizerBuilder for the CUDA one; the CPU
    # accelerator's (above) has no LoCo kernels, so there the test skips, saying why. Only trees
    # from before LoCo's removal (DeepSpeed PR #8534) have the test: the edit applies where it is.
    Edit("tests/unit/runtime/comm/test_coalesced_collectives.py",
         "        quantizer_module = QuantizerBuilder().load()\n",
         "        quantizer_module = QuantizerBuilder().load()\n"
         "        if not hasattr(quantizer_module, \"loco_swizzle_quant\"):\n"
         "            pytest.skip(\"this accelerator's quantizer op has no LoCo kernels\")\n",
         when="class TestLocoQuantized(DistributedTest):"),
    # the new tests are property tests
    Edit("requirements/requirements-dev.txt", "future\nimportlib-metadata>=4\n",
         "future\nhypothesis\nimportlib-metadata>=4\n"),
)

# ZeRO-3's quantized weights (qwZ): the pull requests' own hunks of partition_parameters.py, in order
QWZ_PATH = "deepspeed/runtime/zero/partition_parameters.py"
EDITS += tuple(Edit(QWZ_PATH, old, new) for _, old, new in series_edits(QWZ_PATH))


def edited_paths(in_package: bool = True) -> Tuple[str, ...]:
    """The DeepSpeed source-tree paths the patch edits: those in an installed package (what the
    overlay edits at import), or with in_package False those only DeepSpeed's git tree has."""
    return tuple(sorted({edit.path for edit in EDITS if edit.in_package == in_package}))


def apply_edits(path: str, text: str) -> str:
    """`text` (the upstream file at source-tree `path`) with the patch's edits applied; an edit
    with `when` only where `text` holds that text; an edit with variants in the one form `text` has.

    Raises:
        EditError: an edit's text occurs a different number of times than expected, or more than
            one of its forms occurs.
    """
    for edit in EDITS:
        if edit.path != path or (edit.when and edit.when not in text):
            continue
        forms = ((edit.old, edit.new), ) + edit.variants
        found = [text.count(old) for old, _ in forms]
        present = [form for form, times in zip(forms, found) if times]
        if len(present) != 1 or text.count(present[0][0]) != edit.count:
            counts = "; ".join(f"{old!r} found {times}" for (old, _), times in zip(forms, found))
            raise EditError(f"deepspeed-qgz: expected {edit.count} occurrence(s) of "
                            f"{'one of ' if edit.variants else ''}{counts} in {path}; "
                            "this DeepSpeed release differs from the patched ones")
        old, new = present[0]
        text = text.replace(old, new)
    return text
