"""The server half of a method: the `Strategy` (`strategy`) and its parts, whom to ask and
what each trains (`assign`), map transforms (`maps`), weighting (`weighting`), reducers
and defences (`reducers`, `robust`, `defences`), server updates and optimisers
(`update`, `optimisers`), the server phase (`phase`) and evaluation (`evaluation`). It
imports the vocabulary (`hetfl.core`), never the client half."""
