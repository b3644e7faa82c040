"""The generic path: any causal LM transformers can run, for targets no family in `family.py` describes.

Correct first, speed second. Each request keeps the HF model's own cache (a `DynamicCache` of full layers);
a forward runs each chunk through the HF module on top of its request's cache, after cropping that cache
back to the chunk's start position: rolling back rejected draft tokens is that crop. Models whose cache
cannot be cropped exactly (recurrent state, or a cache the model replaces with its own) are detected at
start-up by a probe and run without a cache: each chunk recomputes its request's whole sequence, still
exact. Same interface as `TargetRunner` (forward, cache, scratch_cache), so the engine, drafters and
schedulers do not know which runs; only automatic prefix caching is off (`supports_prefix_cache`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from dspark.models.target.kv_cache import SlotPool
from dspark.models.target.layer import ForwardOutput, SeqChunk

log = logging.getLogger(__name__)


class GenericCache(SlotPool):
    """Slots like `KVCachePool`, each holding one request's HF cache and its token ids instead of rows of a
    shared K/V tensor."""

    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        self.caches: list[DynamicCache | None] = [None] * max_num_seqs
        self.tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]
        super().__init__(max_num_seqs, max_model_len)

    def _clear(self, slot: int) -> None:
        self.caches[slot], self.tokens[slot] = None, []

    def _move(self, src: int, dst: int) -> None:
        self.caches[dst], self.tokens[dst] = self.caches[src], self.tokens[src]


class GenericRunner:
    """Runs any HF causal LM over a step's chunks, one request at a time (see the module docstring)."""

    supports_prefix_cache = False  # no shared K/V rows to copy prefixes from
    native_attention = False
    fused = None
    gemm_plan = None

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                 gemm_plan: object | None = None, row_invariant: bool = True) -> None:
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.num_layers = self.config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.row_invariant = row_invariant
        self.cache = GenericCache(max_num_seqs, max_model_len)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self._last_layer = self._decoder_layers()[-1] if self._decoder_layers() else None
        self.uses_cache = self._probe_cropped_cache()
        log.info("generic runner for %s: %s", type(model).__name__,
                 "per-request DynamicCache, cropped on rollback" if self.uses_cache
                 else "no croppable cache: each chunk recomputes its whole sequence")

    def _decoder_layers(self) -> list[torch.nn.Module]:
        base = getattr(self.model, "model", None)
        layers = getattr(base, "layers", None) if base is not None else None
        return list(layers) if isinstance(layers, torch.nn.ModuleList) else []

    def takes_native_attention(self, chunks: list[SeqChunk]) -> bool:
        return False

    @contextlib.contextmanager
    def scratch_cache(self, num_seqs: int, max_len: int) -> Iterator[GenericCache]:
        """A temporary set of slots in place of the serving ones (see `TargetRunner.scratch_cache`)."""
        kept = self.cache
        self.cache = GenericCache(num_seqs, min(max_len, kept.max_model_len))
        try:
            yield self.cache
        finally:
            self.cache = kept

    @torch.inference_mode()
    def _probe_cropped_cache(self) -> bool:
        """Whether prefill, a rejected token, a crop and the right token give the logits of one full pass."""
        ids = torch.arange(1, 6, device=self.device)[None] % self.vocab_size
        try:
            full = self.model(input_ids=ids, use_cache=False).logits[0, -2:].float()
            cache = DynamicCache()
            self._run(ids[:, :3], 0, cache, 1)
            self._run((ids[:, 3:4] + 1) % self.vocab_size, 3, cache, 1)
            self._crop(cache, 3)
            got = self._run(ids[:, 3:], 3, cache, 2)[0].float()
        except Exception as exc:  # noqa: BLE001 - any failure means: run without a cache
            log.info("generic runner: cache probe failed (%s)", exc)
            return False
        return bool(torch.allclose(got, full, atol=1e-3 * (1 + full.abs().max().item()), rtol=1e-3))

    def _crop(self, cache: DynamicCache, length: int) -> None:
        current = cache.get_seq_length()
        if current > length:  # a negative count removes that many tokens (transformers 4 and 5 alike)
            cache.crop(length - current)

    def _run(self, ids: torch.Tensor, start_pos: int, cache: DynamicCache | None, num_logits: int,
             need_hidden: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """ids (1, n) at positions start_pos.. -> logits (num_logits, V), hidden states (HF's tuple) or None."""
        positions = torch.arange(start_pos, start_pos + ids.shape[1], device=self.device)[None]
        kwargs: dict[str, object] = {"input_ids": ids, "position_ids": positions, "use_cache": cache is not None,
                                     "output_hidden_states": need_hidden}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._keeps_logits:
            kwargs["logits_to_keep"] = num_logits
        out = self.model(**kwargs)
        return out.logits[0, -num_logits:], (out.hidden_states if need_hidden else None)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Each chunk on top of its slot's cache cropped to its start: logits of its last num_logits tokens
        (chunk order) and hidden states (T, D) of the requested layers (i = after decoder layer i, pre-norm)."""
        logits: list[torch.Tensor] = []
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in hidden_layers}
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            if end > self.cache.max_model_len:
                raise ValueError(f"sequence of {end} tokens exceeds max_model_len={self.cache.max_model_len}")
            tokens = self.cache.tokens[c.slot][:c.start_pos] + list(c.token_ids)
            if len(tokens) != end:
                raise ValueError(f"slot {c.slot} holds {len(self.cache.tokens[c.slot])} tokens; a chunk cannot "
                                 f"start at {c.start_pos}")
            self.cache.tokens[c.slot] = tokens
            n = len(c.token_ids)
            if self.uses_cache:
                cache = self.cache.caches[c.slot] if c.start_pos > 0 else None
                cache = cache if cache is not None else DynamicCache()
                self._crop(cache, c.start_pos)
                self.cache.caches[c.slot] = cache
                ids, start = torch.tensor([c.token_ids], device=self.device), c.start_pos
            else:  # the whole sequence again, no cache
                cache, ids, start = None, torch.tensor([tokens], device=self.device), 0
            last_hidden = self._capture_last_layer(self.num_layers in hidden_layers)
            with last_hidden:
                rows, states = self._run(ids, start, cache, c.num_logits, need_hidden=bool(hidden_layers))
            logits.append(rows[-c.num_logits:])
            for i in hidden_layers:
                # HF's last entry is after the final norm: the runner's is the last layer's output
                h = last_hidden.output if i == self.num_layers and last_hidden.output is not None else states[i]
                hidden[i].append(h[0, -n:])
        return ForwardOutput(logits=torch.cat(logits),
                             hidden_states={i: torch.cat(parts) for i, parts in hidden.items()})

    def _capture_last_layer(self, wanted: bool) -> _LayerOutput:
        return _LayerOutput(self._last_layer if wanted else None)


class _LayerOutput(contextlib.AbstractContextManager):
    """Keeps a decoder layer's output (B, L, D) while the context is open (a forward hook)."""

    def __init__(self, layer: torch.nn.Module | None) -> None:
        self.layer = layer
        self.output: torch.Tensor | None = None
        self._handle = None

    def __enter__(self) -> _LayerOutput:
        if self.layer is not None:
            self._handle = self.layer.register_forward_hook(self._keep)
        return self

    def _keep(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.output = output[0] if isinstance(output, tuple) else output

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
