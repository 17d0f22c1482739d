"""Models from other libraries as twobp pipeline blocks (each behind an optional dependency).

This package itself imports no torch and none of those libraries: its constants
serve command-line options before anything heavy loads.
"""

TRANSFORMERS_FAMILIES = ("llama", "gpt2", "bert", "mamba")
"""The Hugging Face ``transformers`` layouts that :mod:`twobp.integrations.transformers` covers."""

SPEECH_FAMILIES = ("wav2vec2", "hubert")
"""The Hugging Face speech models with a CTC head that :mod:`twobp.integrations.wav2vec2`
covers (``Wav2Vec2ForCTC``, ``HubertForCTC``)."""
