"""Test-only faults the parity comparisons must catch, shared by the CPU tests and the GPU worker. Each takes
`patch` (`setattr`, or pytest's `monkeypatch.setattr` to undo it after the test)."""

import dataclasses

UNCACHED = {"VLLM_DISABLE_COMPILE_CACHE": "1"}
"""The environment of an engine started with a fault in: a fault patches Python that vLLM's compile cache is not
keyed by (0.34's AOT cache checks only the files the cached graph traced), so the engine compiles afresh rather
than load a correct engine's graphs."""


def break_state_carry(patch=setattr) -> None:
    """Every step starts from a fresh PLE state (EOS n-gram context, zero conv window): nothing is carried
    between chunks or decode steps."""
    import torch

    from qwen4_exp_hcu.model import ple

    pack = ple.pack

    def fresh_every_step(metadata, input_ids):
        batch = pack(metadata, input_ids)
        return dataclasses.replace(batch, has_initial_state=torch.zeros_like(batch.has_initial_state))

    patch(ple, "pack", fresh_every_step)


def double_last_ranks_rows(patch=setattr) -> None:
    """The ETP combine counts the rows the last rank of each group owns twice (its lookup doubled before the
    all-reduce, which gloo's reduce-scatter runs too)."""
    from qwen4_exp_hcu.ple.etp import TorchGroup

    all_reduce = TorchGroup.all_reduce

    def doubled(self, x):
        return all_reduce(self, x * 2 if self.rank_in_group == self.world_size - 1 else x)

    patch(TorchGroup, "all_reduce", doubled)


def double_last_ranks_lookup(patch=setattr) -> None:
    """The same fault as `double_last_ranks_rows` through whatever group the lookup combines over: the last ETP
    rank's own lookup doubled before the combine. vLLM hands the lookup its `GroupCoordinator`, which the
    `TorchGroup` patch does not reach (`vllm serve` at TP = 2)."""
    from qwen4_exp_hcu.ple.etp import ETPLookup

    call = ETPLookup.__call__

    def doubled(self, ids, out=None, max_tokens=None):
        group = self.group
        if group is None or group.rank_in_group != group.world_size - 1:
            return call(self, ids, out, max_tokens)
        lookup = self.table.lookup
        self.table.lookup = lambda rows, out=None: lookup(rows, out=out).mul_(2)
        try:
            return call(self, ids, out, max_tokens)
        finally:
            del self.table.lookup

    patch(ETPLookup, "__call__", doubled)


# The row error the end-to-end bounds must catch (`scale_table_rows`): 10 %. Smaller ones sit too close to bf16 noise
# for a bound 3x above the clean runs (`helpers.scenarios.TINY`).
ROW_ERROR = 1.10


def scale_table_rows(patch=setattr, factor: float = ROW_ERROR) -> None:
    """Every PLE row read `factor` times too large, as INT8 row scales (or a table-level scale) that far off would
    make them."""
    from qwen4_exp_hcu.ple.table import PLETable

    lookup = PLETable.lookup

    def scaled(self, ids, out=None):
        return lookup(self, ids, out=out).mul_(factor)

    patch(PLETable, "lookup", scaled)


def shift_ple_state_restore(patch=setattr) -> None:
    """A prefix-cache hit restores each PLE window one entry late (the copy starts one position past the cached
    block's window). Patched where every vLLM runner asks for the copy functions: the model class (the running
    engine's runner keeps them once built, so the fault goes into an engine started after it). vLLM 0.34's runner
    only reads which kind of copy each state takes and copies every state in one fused kernel
    (`_shift_fused_ple_copies`)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec

    from qwen4_exp_hcu.model.model import Qwen4ExpForCausalLM
    from qwen4_exp_hcu.model.ple import PLE_MAMBA_TYPE

    def shifted(state, block_ids, cur_block_idx, num_accepted_tokens):
        return get_conv_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens + 1)

    copy_funcs = Qwen4ExpForCausalLM.get_mamba_state_copy_funcs.__func__

    def with_shifted_ple(cls, mamba_types):
        funcs = copy_funcs(cls, mamba_types)
        return {**funcs, **({PLE_MAMBA_TYPE: (shifted, shifted)} if PLE_MAMBA_TYPE in funcs else {})}

    for cls in _model_classes():
        patch(cls, "get_mamba_state_copy_funcs", classmethod(with_shifted_ple))
    _shift_fused_ple_copies(shifted, get_conv_copy_spec, patch)


def _model_classes() -> list[type]:
    """This package's model classes (the multimodal one where its imports are installed): the multimodal class takes
    the text class's attributes when its module loads, so a fault on the text class alone misses it once loaded."""
    from qwen4_exp_hcu.model.model import Qwen4ExpForCausalLM

    try:
        from qwen4_exp_hcu.model.multimodal import Qwen4ExpForConditionalGeneration
    except ImportError:
        return [Qwen4ExpForCausalLM]
    return [Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration]


def _shift_fused_ple_copies(shifted, conv_copy, patch) -> None:
    """Where vLLM copies the states in one fused kernel (`MambaSpecDecodeGPUContext`), a state marked `shifted`
    takes the plain conv copy, and after each align-mode pre-copy the marked states are copied again from the same
    source one token further along: their windows land one entry late."""
    import copy

    import torch

    try:
        from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext as Context
        from vllm.v1.worker.mamba_utils import _get_mamba_spec_for_layer as layer_spec
    except ImportError:  # runners that call the copy functions themselves
        return
    populate, precopy = Context._populate_metadata, Context.run_fused_precopy

    def populate_marked(self, kv_cache_config, forward_context, copy_funcs, *tables):
        marked, idx = [], 0
        for group_id in self.mamba_group_ids:
            group = kv_cache_config.kv_cache_groups[group_id]
            for name in group.layer_names:
                funcs = copy_funcs[layer_spec(group, name).mamba_type]
                marked += [idx + i for i, f in enumerate(funcs) if f is shifted]
                idx += len(funcs)
        plain = {kind: tuple(conv_copy if f is shifted else f for f in funcs) for kind, funcs in copy_funcs.items()}
        populate(self, kv_cache_config, forward_context, plain, *tables)
        if marked:
            only = torch.tensor(marked, device=self.state_base_addrs.device)
            self.shifted_states = copy.copy(self)
            for name in ("state_base_addrs", "state_block_strides", "state_elem_sizes", "state_inner_sizes",
                         "state_conv_widths", "state_group_indices", "state_dim_row_count", "state_dim_row_stride"):
                setattr(self.shifted_states, name, getattr(self, name)[only].contiguous())  # fmt: skip
            self.shifted_states.num_states = len(marked)

    def precopy_then_shift(self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping):
        precopy(self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping)
        if getattr(self, "shifted_states", None) is not None:
            precopy(self.shifted_states, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu + 1, idx_mapping)

    patch(Context, "_populate_metadata", populate_marked)
    patch(Context, "run_fused_precopy", precopy_then_shift)


def dense_attention_beyond_the_budget(patch=setattr) -> None:
    """Every attention layer dense, also where a sequence outgrows the QSA indexer's budget: long prompts served
    without the indexer's block selection."""
    from qwen4_exp_hcu.model import model

    patch(model, "qsa_builder", lambda vllm_config: None)


def later_stage_ids_shifted(patch=setattr) -> None:
    """Pipeline stages after the first hash the token ids one position late (the ids a stage receives rolled
    by one): what a stage PLE-hashing ids other than the first stage's would do."""
    from vllm.sequence import IntermediateTensors

    from qwen4_exp_hcu.model.model import Qwen4ExpModel

    forward = Qwen4ExpModel.forward

    def shifted(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if intermediate_tensors is not None:
            ids = intermediate_tensors["input_ids"].roll(1)
            intermediate_tensors = IntermediateTensors({**intermediate_tensors.tensors, "input_ids": ids})
        return forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)

    patch(Qwen4ExpModel, "forward", shifted)


def swap_fused_expert_halves(patch=setattr) -> None:
    """The BF16 release's fused routed experts (`mlp.experts.gate_up_proj`, [experts, 2 x intermediate, hidden])
    loaded with their gate and up halves swapped: the fused layout read in the other order."""
    import torch

    from qwen4_exp_hcu.model.model import Qwen4ExpForCausalLM

    load_weights = Qwen4ExpForCausalLM.load_weights

    def swapped(self, weights):
        def stream():
            for name, tensor in weights:
                if name.endswith("mlp.experts.gate_up_proj"):
                    tensor = torch.cat(tensor.chunk(2, dim=-2)[::-1], dim=-2)
                yield name, tensor

        return load_weights(self, stream())

    patch(Qwen4ExpForCausalLM, "load_weights", swapped)


def sequential_image_positions(patch=setattr) -> None:
    """Image tokens get sequential positions (the shortcut of a text-only model) instead of M-RoPE's."""
    import torch

    from qwen4_exp_hcu.model.multimodal import Qwen4ExpForConditionalGeneration

    patch(
        Qwen4ExpForConditionalGeneration, "get_mrope_input_positions",
        lambda self, tokens, mm_features: (torch.arange(len(tokens)).expand(3, -1), 0),
    )  # fmt: skip


def keep_rejected_drafts(patch=setattr) -> None:
    """Speculative steps store the PLE window after the last draft, as if every draft were accepted."""
    from qwen4_exp_hcu.model import ple_step

    pack = ple_step.pack_speculative
    patch(ple_step, "pack_speculative", lambda m, ids: dataclasses.replace(pack(m, ids), verify=None))
