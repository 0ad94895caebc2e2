"""The parts of the prose corpus builder (``tools/build_prose_corpus.py``): the pinned
sources (:mod:`.sources`), reading packages and converting markup (:mod:`.convert`), and the
prose and deduplication rules (:mod:`.clean`)."""
