"""Published models on relattn: :mod:`.transformers` patches Hugging Face models in place (``patch(model)``),
:mod:`.bert` loads transformers-4 BERT ``relative_key`` checkpoints (``load_bert_relative_key(path)``).

Both need ``transformers >= 5`` (the ``hf`` extra); importing this package does not import it.
"""
