"""Training data: the in-memory dataset and loader (``dataset``), streamed corpora
(``streaming``), the offline tokenizer run (``prepare``, the ``hp-train-prepare`` command) and
the memory-mapped token files it writes (``prepared``)."""
