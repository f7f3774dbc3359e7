"""The built-in compression methods, one module each.

Nothing imports these modules by name: the method registry (:mod:`veloxpatch.registry`) loads every module
of this package, and each registers its cache class with ``@method``. A method from another package plugs
in the same way through an entry point (see ``docs/DESIGN.md``, "Adding a method").
"""
