"""Local training from parts: `parts` (the protocols, the context and `LocalRecipe`),
`optim` (the functional optimisers), `loop` (the step and the loop), `stacked` (the step
on clients stacked together), `terms` and `regularisers` (generic parts methods share)."""
