"""Models from other libraries as twobp pipeline blocks (each behind an optional dependency).

This package itself imports no torch and none of those libraries: its constants
serve command-line options before anything heavy loads.
"""

TRANSFORMERS_FAMILIES = ("llama", "gpt2", "bert", "mamba")
"""The Hugging Face ``transformers`` layouts that :mod:`twobp.integrations.transformers` covers."""

MIXTURE_FAMILIES = ("mixtral",)
"""Mixtures of experts that :func:`twobp.integrations.transformers.build_model` builds
(LLaMA-family layouts: :func:`~twobp.integrations.transformers.blocks` cuts them as such,
their routers' auxiliary loss added by its ``loss_function``)."""

SPEECH_FAMILIES = ("wav2vec2", "hubert")
"""The Hugging Face speech models with a CTC head that :mod:`twobp.integrations.wav2vec2`
covers (``Wav2Vec2ForCTC``, ``HubertForCTC``)."""
