"""Forge: tools Claude writes at runtime, run schema-bound in a bubblewrap sandbox and audited.

Modules: ``sandbox`` (bwrap argv, limits, output capture), ``redact``
(secrets out of outputs), ``registry`` / ``scopes`` (the tool table),
``static_check``, ``policy``, ``breakers``, ``cache``, ``runs`` (manifests)
and ``service`` (the call path).  The bus side is ``capsules/forge``.
"""
