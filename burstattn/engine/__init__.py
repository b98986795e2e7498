"""The engine: block ops from positions (``pairs``), plans (pure: ``plan``, ``direct``), the one step loop
(``loop``), the passes (``passes``), the merge (``merge``) and the entry points (``run``). Import from the
module that holds a name: this package re-exports nothing, so importing it does no work."""
