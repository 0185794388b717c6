"""Published models on relattn: :mod:`.transformers` patches Hugging Face models in place (``patch(model)``),
:mod:`.bert` loads transformers-4 BERT ``relative_key`` checkpoints (``load_bert_relative_key(path)``).

Both need ``transformers >= 5`` (the ``hf`` extra); importing this package does not import it.
:mod:`.eole` patches eole models with ``position_encoding_type: Relative`` (``patch(model)``), training and
cached decoding; it needs eole 0.6 only to have a model to patch.
"""
