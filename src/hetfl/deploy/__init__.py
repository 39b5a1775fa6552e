"""HetFL on Flower: the strategy as a `ServerApp`, the client program as a `ClientApp`.

The second engine, beside the simulator (docs/deploy.md). `hetfl.deploy.server` holds the
round loop on a Flower `Grid`, `hetfl.deploy.node` the client side (`make_client_app`),
`hetfl.deploy.codec` and `hetfl.deploy.records` the wire format. The engine takes explicit
parts and never reads a config: the face builds them, in `hetfl.flower` (the apps Flower
loads) and `hetfl.launch` (the `hetfl serve` / `hetfl client` commands). Importing this
package imports nothing of Flower, so the rest of HetFL works without it; the submodules need the
`flower` extra (`pip install 'hetfl[flower]'`), except `codec`, which is plain.
"""
