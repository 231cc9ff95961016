"""Sampling parameters of one request, and their protocol codec (the router builds them, engines obey them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvmesh.proto.v1 import common_pb2

DEFAULT_MAX_TOKENS = 64
MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (vLLM's _SAMPLING_EPS): 1/T would swamp any logit gap
# the smallest positive float32: a legal top_p below it must not round to 0, which the wire reads as "off" (1.0)
F32_TINY = 1.401298464324817e-45


MAX_LOGPROBS = 20  # most likely tokens a request may ask for beside each sampled one (OpenAI's top_logprobs cap)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
LOGITS = "logits"  # an engine feature: the penalties, min_p, min_tokens and logit_bias (``messages.FEATURES``)
PROMPT_LOGPROBS = "prompt_logprobs"  # an engine feature: ``SamplingParams.prompt_logprobs``
SPECIAL_TOKENS = "special_tokens"  # an engine feature: ``SamplingParams.skip_special_tokens`` False
MAX_REPETITION_PENALTY = 10.0

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced by the engine as a token mask (a compiled grammar).

    ``spec``: the JSON schema as JSON text (``json_schema``), the pattern (``regex``), the options as a JSON
    list of strings (``choice``), the EBNF text (``grammar``); empty for ``json_object``. Checked for shape
    here; whether it compiles is the router's (validation) and the engine's (compilation) business."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"not {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)))

    @property
    def options(self) -> list[str]:
        """The strings of a ``choice``."""
        return json.loads(self.spec) if self.kind == "choice" else []

    @property
    def key(self) -> str:
        """The canonical form compiled grammars are cached under: a schema with its keys sorted (so the same
        schema written in another key order compiles once), every other spec as is."""
        if self.kind == "json_schema":
            return "json_schema:" + json.dumps(json.loads(self.spec), sort_keys=True, separators=(",", ":"))
        return f"{self.kind}:{self.spec}"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0          # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings (matched on detokenized text by the caller that owns text)
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # the output must match this grammar (JSON schema, regex, ...)
    logprobs: int | None = None       # None: off; N: each generated token's logprob and the N most likely (<= 20)
    # None: off; N: each prompt token's logprob after the first, its rank and the N most likely there (<= 20),
    # computed from the whole prompt (no reused KV: a reused prefix has no logits)
    prompt_logprobs: int | None = None
    # what the logits go through before sampling (OpenAI's and vLLM's meanings; defaults: nothing)
    presence_penalty: float = 0.0     # subtracted from a token's logit once it was generated at all
    frequency_penalty: float = 0.0    # ... times the number of times it was generated
    repetition_penalty: float = 1.0   # a token of the prompt or the output: its logit / r if > 0, else * r
    min_p: float = 0.0                # tokens less likely than min_p x the most likely one are dropped
    min_tokens: int = 0               # no EOS, stop token or stop string before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids ascending
    # the output text leaves special tokens out (vLLM's default); False keeps them (a tool-call form written in
    # special tokens). The token that stops the output (EOS, a stop token) adds no text either way.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.temperature >= 0:  # also nan
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # also nan
                raise ValueError(f"{name} must be in [-2, 2], not {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), not "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], not {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, not {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: token {token}'s bias must be in [-100, 100] for a token id >= 0, "
                                 f"not {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def features(self) -> tuple[str, ...]:
        """What an engine must apply beyond the base set to serve these (``messages.FEATURES``'s names)."""
        return (((LOGITS,) if self.penalized or self.min_p else ())
                + ((PROMPT_LOGPROBS,) if self.prompt_logprobs is not None else ())
                + ((SPECIAL_TOKENS,) if not self.skip_special_tokens else ()))

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (the penalties, ``min_tokens``) or are biased."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)


def structured_from_proto(p: common_pb2.SamplingParams) -> StructuredOutput | None:
    which = p.WhichOneof("structured")
    if which is None:
        return None
    if which == "json_object":
        return StructuredOutput("json_object") if p.json_object else None
    if which == "choice":
        return StructuredOutput.choice(list(p.choice.options))
    return StructuredOutput(which, getattr(p, which))


def structured_to_proto(s: StructuredOutput, msg: common_pb2.SamplingParams) -> None:
    if s.kind == "json_object":
        msg.json_object = True
    elif s.kind == "choice":
        msg.choice.options.extend(s.options)
    else:
        setattr(msg, s.kind, s.spec)


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError with a message naming the bad field."""
    return SamplingParams(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        structured=structured_from_proto(p),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        skip_special_tokens=not p.keep_special_tokens,
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                    top_p=max(s.top_p, F32_TINY), stop_token_ids=list(s.stop_token_ids),
                                    stop=list(s.stop), ignore_eos=s.ignore_eos,
                                    keep_special_tokens=not s.skip_special_tokens)
    if s.seed is not None:
        msg.seed = s.seed
    if s.structured is not None:
        structured_to_proto(s.structured, msg)
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    logits_to_proto(s, msg)
    return msg


def logits_to_proto(s: SamplingParams, msg: common_pb2.SamplingParams) -> None:
    """``s``'s logit adjustments (penalties, min_p, min_tokens, logit_bias) into ``msg``."""
    msg.presence_penalty, msg.frequency_penalty, msg.min_p = s.presence_penalty, s.frequency_penalty, s.min_p
    msg.min_tokens = s.min_tokens
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    msg.logit_bias.update(dict(s.logit_bias))
