"""Adversaries: malicious clients and the attacks they run (`hetfl.attacks.malicious`,
`hetfl.attacks.poisoning`, `hetfl.attacks.backdoor`); importing the package registers the
built-in attack kinds in `hetfl.attacks.registry.ATTACKS`. Defences are reducer kinds
(`hetfl.core.server.reducers`)."""

from hetfl.attacks import backdoor, poisoning  # noqa: F401 (registers the attacks)
