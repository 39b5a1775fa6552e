"""The client half of a method: the client program (`program`), its wrappers by name
(`wrappers`), local training from parts (`recipe`: the protocols, the context and
`LocalRecipe`; `optim`: the functional optimisers; `loop`: the step and the loop;
`stacked`: the step on clients stacked together; `terms`, `regularisers` and `privacy`:
generic parts methods share), and what a client computes besides (`scoring`,
`bn_statistics`, `dropout`). It imports the vocabulary (`hetfl.core`), never the server
half."""
