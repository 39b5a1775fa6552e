"""The engine-neutral round machinery both engines (`hetfl.sim`, `hetfl.deploy`) share.

The round template (`rounds.RoundLoop`), the steps of a round that do not depend on how
clients are reached (`steps`), run outputs (`outputs`), experiment tracking fed by the
same rows (`tracking`), checkpoints (`checkpoint`), the progress display (`progress`) and
the record of a run's explicit parts (`parts`). It
imports neither engine, nor the face (config, report, CLI): the face builds the parts.
"""
