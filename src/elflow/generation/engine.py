"""The one path from a network to text (an elflow addition; the sampler is ELF_SPEC §5).

Every request (unconditional, conditional, infilling, length-controlled) is cut into rows, one
per sample: a :class:`Row` holds the sample's seed and index, whose functions alone are its noise,
its step times and its gap lengths, its source (a conditional model) and its infill layout (kept
text and gaps). :func:`run_rows` samples any rows that share a sampler as one batch and returns
their texts; a row's result does not depend on the other rows in its batch, so a caller may batch
rows of different requests, seeds and lengths together (``elflow serve`` does) and get what each
request would get alone. The pipeline, the CLI, the sweep, training-time samples, the demo and
the trajectory page all sample through here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from elflow.config import SamplerConfig
from elflow.errors import ELFError
from elflow.generation import cuda_graphs as graphs
from elflow.generation.infill import InfillRequest, build_template, length_requests
from elflow.generation.infill_texts import fill_texts, kept_texts, survives, verbatim_text
from elflow.generation.outputs import Generation, Infilled
from elflow.sampling import (
    Condition,
    Seeds,
    StepCallback,
    StepState,
    sample,
    sample_generators,
    seed_of,
)
from elflow.sampling.denoiser import decode_logits, make_denoiser, sample_model, sampling_w
from elflow.sampling.infill_maths import (
    FillVocabulary,
    Template,
    constrained_tokens,
    initial_condition,
    refresh_denoiser,
)
from elflow.sampling.projection import Projection

if TYPE_CHECKING:
    from elflow.io.artifact import ArtifactConfig
    from elflow.model import ELF
    from elflow.text.encoder import FrozenEncoder
    from elflow.text.tokens import TokenSpec

StepTexts = Callable[[int, list[str]], None]
"""``on_step(k, texts)``: each row's decoded text after step k (from 0), as the steps run."""


class SamplingPipeline(Protocol):
    """What the engine uses of a pipeline (:class:`elflow.ELFPipeline` is one): the network, its
    config, tokenizer and frozen encoder, and how its rows are encoded and decoded."""

    model: ELF
    config: ArtifactConfig
    tokenizer: Any
    tokens: TokenSpec

    @property
    def device(self) -> torch.device: ...

    @property
    def row_pad_id(self) -> int: ...

    @property
    def fill_vocabulary(self) -> FillVocabulary: ...

    def frozen_encoder(self, what: str) -> FrozenEncoder: ...

    def encode_sources(self, sources: Sequence[str]) -> tuple[Condition, Tensor]: ...

    def strip_source(self, tokens: Tensor, cond_mask: Tensor | None) -> Tensor: ...

    def detokenize(self, tokens: Tensor, cond_mask: Tensor | None = None) -> list[str]: ...


@dataclass(frozen=True)
class Row:
    """One sample to write."""

    seed: int
    index: int
    """Sample ``index`` of ``seed``: its noise, step times and gap lengths depend on these alone."""
    source: str | None = None
    """A conditional model's source text."""
    infill: InfillRequest | None = None
    """Kept text and gaps (infilling, length control); None samples the whole row freely."""

    @property
    def kind(self) -> str:
        """Rows of one kind (and one sampler) run as one batch: ``free`` or ``infill``."""
        return "free" if self.infill is None else "infill"


def make_rows(
    indices: Sequence[int],
    *,
    seed: Seeds = 0,
    sources: Sequence[str] | None = None,
    infill: Sequence[InfillRequest] | None = None,
) -> list[Row]:
    """Rows for samples ``indices`` of ``seed`` (one for all, or one per sample), with their
    sources and infill requests when given (one per sample)."""
    return [
        Row(
            seed_of(seed, k),
            int(i),
            sources[k] if sources is not None else None if infill is None else infill[k].source,
            None if infill is None else infill[k],
        )
        for k, i in enumerate(indices)
    ]


def with_lengths(pipe: SamplingPipeline, rows: Sequence[Row], sampler: SamplerConfig) -> list[Row]:
    """Under ``sampler.length_range`` a free row becomes a one-gap infill row of a length drawn
    from its (seed, index) (:func:`elflow.generation.infill.length_requests`); else unchanged."""
    if not sampler.length_range:
        return list(rows)
    cfg, out = pipe.config, []
    for row in rows:
        if row.infill is not None:
            out.append(row)
            continue
        (request,) = length_requests(
            sampler.length_range,
            [row.index],
            seed=row.seed,
            histogram=cfg.length_histogram,
            tokens_per_word=cfg.tokens_per_word,
        )
        request.source = row.source
        out.append(Row(row.seed, row.index, row.source, request))
    return out


@dataclass(frozen=True)
class StepWatch:
    """What watches a batch's steps: the per-step texts kept for a trajectory (``frames``),
    ``on_step`` (texts as they are made) and the caller's step callback."""

    frames: list[list[str]] | None = None
    on_step: StepTexts | None = None
    callback: StepCallback | None = None

    @property
    def decodes(self) -> bool:
        """Whether each step's texts are decoded (a trajectory, or ``on_step``)."""
        return self.frames is not None or self.on_step is not None

    def hook(self, texts_of: Callable[[Tensor], list[str]]) -> StepCallback | None:
        """The step callback that decodes each step's texts (``texts_of``) for the watchers."""
        if not self.decodes:
            return self.callback
        frames, on_step, callback = self.frames, self.on_step, self.callback

        def hook(state: StepState) -> None:
            if state.tokens is not None:
                texts = texts_of(state.tokens)
                if frames is not None:
                    frames.append(texts)
                if on_step is not None:
                    on_step(state.step, texts)
            if callback is not None:
                callback(state)

        return hook


@torch.no_grad()
def run_rows(
    pipe: SamplingPipeline,
    rows: Sequence[Row],
    sampler: SamplerConfig,
    *,
    projection: Projection | None = None,
    trajectory: bool = False,
    on_step: StepTexts | None = None,
    callback_on_step_end: StepCallback | None = None,
    cuda_graphs: bool | None = None,
) -> Generation | Infilled:
    """Sample ``rows`` (all ``free`` or all ``infill``, :attr:`Row.kind`) as one batch, unchecked:
    the pipeline's ``prepare`` checks a request first. Free rows return a :class:`Generation`,
    infill rows an :class:`Infilled`; with ``trajectory`` each step's texts come back too, and
    ``on_step`` gets them as they are made. ``cuda_graphs``: replay each step as a CUDA graph
    (None: on CUDA; :mod:`elflow.generation.cuda_graphs`)."""
    mode = graphs.graph_mode(cuda_graphs, pipe.device)
    if not rows:
        raise ELFError("no rows to sample")
    kinds = {row.kind for row in rows}
    if len(kinds) > 1:
        raise ELFError("a batch mixes free and infill rows; run each kind as its own batch")
    if sampler.length_range and "free" in kinds:
        rows = with_lengths(pipe, rows, sampler)
        kinds = {"infill"}
    watch = StepWatch([] if trajectory else None, on_step, callback_on_step_end)
    gens = sample_generators([r.seed for r in rows], [r.index for r in rows], pipe.device)
    if kinds == {"free"}:
        return _sample_free(
            pipe,
            rows,
            sampler,
            generators=gens,
            watch=watch,
            projection=projection,
            cuda_graphs=cuda_graphs,
        )
    return _sample_infill(pipe, rows, sampler, generators=gens, watch=watch, mode=mode)


def _sample_free(
    pipe: SamplingPipeline,
    rows: Sequence[Row],
    sampler: SamplerConfig,
    *,
    generators: list[torch.Generator],
    watch: StepWatch,
    projection: Projection | None,
    cuda_graphs: bool | None,
) -> Generation:
    """Free rows (a conditional model's with their sources) through :func:`sample_model`."""
    cond, cond_mask = None, None
    if pipe.config.conditional:
        sources = [r.source for r in rows]
        if any(s is None for s in sources):
            raise ELFError("this model is conditional: every sample needs a source")
        cond, cond_mask = pipe.encode_sources(sources)
    elif any(r.source is not None for r in rows):
        raise ELFError("this model is unconditional: it takes no sources")
    out = sample_model(
        pipe.model,
        generators,
        pipe.config.sample_length(sampler),
        sampler,
        noise_scale=pipe.config.noise_scale,
        t_eps=pipe.config.t_eps,
        cond=cond,
        trajectory=watch.decodes,
        projection=projection,
        callback_on_step_end=watch.hook(lambda t: pipe.detokenize(t, cond_mask)),
        cuda_graphs=cuda_graphs,
    )
    texts = pipe.detokenize(out.tokens, cond_mask)
    return Generation(texts, pipe.strip_source(out.tokens, cond_mask).cpu(), watch.frames)


def _sample_infill(
    pipe: SamplingPipeline,
    rows: Sequence[Row],
    sampler: SamplerConfig,
    *,
    generators: list[torch.Generator],
    watch: StepWatch,
    mode: str | None,
) -> Infilled:
    """Infill rows: kept positions held at the encoder's clean latents, fills decoded under the
    template's constraints (:mod:`elflow.sampling.infill_maths`)."""
    cfg, model, tok = pipe.config, pipe.model, pipe.tokens
    L, dev = cfg.model.max_length, pipe.device
    requests = [r.infill for r in rows]
    template = build_template(
        pipe.tokenizer,
        requests,
        length=L,
        pad_id=pipe.row_pad_id,
        eos_id=tok.eos_id,
        indices=[r.index for r in rows],
        seed=[r.seed for r in rows],
        max_input_length=cfg.max_input_length if cfg.conditional else 0,
    )
    template = Template(*(None if x is None else x.to(dev) for x in vars(template).values()))
    encoder = pipe.frozen_encoder("infilling and length control")

    def encode(ids: Tensor, attention: Tensor, source: Tensor | None) -> Tensor:
        return encoder(ids, attention, None if source is None else source.long())

    vocab = pipe.fill_vocabulary
    cond = initial_condition(template, encode)
    w = sampling_w(model, sampler.w)
    denoise = make_denoiser(model, w, cfg.t_eps, cond, sampler.cfg)

    def logits(z: Tensor) -> Tensor:
        return decode_logits(model, z, w)

    if sampler.refresh_from < 1.0 or sampler.project_from < 1.0:
        mode = None  # an encoder pass on rows picked by their time: eager (no CUDA graph)
        denoise = refresh_denoiser(
            denoise,
            logits,
            encode,
            template,
            vocab,
            cond,
            refresh_from=sampler.refresh_from,
            t_eps=cfg.t_eps,
            project_from=sampler.project_from,
        )
    shape = (L, cfg.model.encoder_dim)
    make = partial(make_denoiser, model, w, cfg.t_eps, cfg=sampler.cfg)
    with graphs.sampling_steps(
        model,
        make,
        len(rows),
        shape,
        sampler,
        noise_scale=cfg.noise_scale,
        t_eps=cfg.t_eps,
        cond=cond,
        mode=mode,
        kind="infill",
    ) as runner:
        out = sample(
            denoise,
            lambda z: constrained_tokens(logits(z), template, vocab),
            generators,
            shape,
            sampler,
            noise_scale=cfg.noise_scale,
            cond=cond,
            trajectory=watch.decodes,
            t_eps=cfg.t_eps,
            callback_on_step_end=watch.hook(lambda t: pipe.detokenize(t, template.source)),
            runner=runner,
        )
    decoded = pipe.detokenize(out.tokens, template.source)
    kept = [kept_texts(pipe.tokenizer, template, b) for b in range(len(rows))]
    fills = fill_texts(pipe.tokenizer, template, out.tokens)
    return Infilled(
        texts=[verbatim_text(r, f, d) for r, f, d in zip(requests, fills, decoded, strict=True)],
        fills=fills,
        kept=kept,
        survived=[survives(t, k) for t, k in zip(decoded, kept, strict=True)],
        tokens=pipe.strip_source(out.tokens, template.source).cpu(),
        trajectory=watch.frames,
    )


def infill_batch(
    pipe: SamplingPipeline,
    requests: Sequence[InfillRequest],
    sampler: SamplerConfig,
    *,
    seed: Seeds = 0,
    indices: Sequence[int] | None = None,
    trajectory: bool = False,
    callback_on_step_end: StepCallback | None = None,
    cuda_graphs: bool | None = None,
) -> Infilled:
    """Fill ``requests`` in one batch with ``pipe``'s model, unchecked: see
    :meth:`elflow.ELFPipeline.infill`. Request b is sample ``indices[b]`` (default b) of its
    seed (``seed``: one for all or one per request): its noise and gap lengths depend on these
    alone, not on the rest of the batch (:func:`run_rows`; ``cuda_graphs`` as there)."""
    indices = range(len(requests)) if indices is None else indices
    return run_rows(
        pipe,
        make_rows(indices, seed=seed, infill=requests),
        sampler,
        trajectory=trajectory,
        callback_on_step_end=callback_on_step_end,
        cuda_graphs=cuda_graphs,
    )
