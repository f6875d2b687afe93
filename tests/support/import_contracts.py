"""An import-linter contract type: modules may import the standard library and a short list, nothing else.

import-linter's built-in contracts say what may NOT be imported; "the core imports only the
standard library and msgspec" is an allow-list, and a forbidden list of every third-party
package installed would go stale as soon as a dependency is added. Registered in
pyproject.toml (``[tool.importlinter] contract_types``) as ``allowed_imports``::

    [[tool.importlinter.contracts]]
    type = "allowed_imports"
    source_modules = ["bridge.core"]
    allowed_modules = ["bridge.core", "msgspec"]

Every module in (or under) ``source_modules`` may import the standard library
(``sys.stdlib_module_names``) and ``allowed_modules`` (a module and its descendants);
any other direct import breaks the contract. Needs ``include_external_packages = true``
(grimp then records each imported top-level package of another distribution).
``checked_modules`` (optional) narrows what is checked to the imports of those packages:
``["bridge"]`` says which of the bridge's own modules may be imported and leaves the
third-party packages free (the services: only the runtime, the core and their own).
"""

from __future__ import annotations

import sys

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _within(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


class AllowedImportsContract(Contract):
    type_name = "allowed_imports"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False, default=[])
    checked_modules = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = set(self.source_modules)  # type: ignore[arg-type]
        allowed = set(self.allowed_modules)  # type: ignore[arg-type]
        checked = set(self.checked_modules)  # type: ignore[arg-type]
        stdlib = set(sys.stdlib_module_names)
        importers = sorted(m for m in graph.modules if _within(m, sources))
        missing = sorted(s for s in sources if s not in graph.modules)
        violations: list[dict[str, object]] = []
        for importer in importers:
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if imported.split(".")[0] in stdlib or _within(imported, allowed):
                    continue
                if checked and not _within(imported, checked):
                    continue
                details = graph.get_import_details(importer=importer, imported=imported)
                lines = [f"l.{d['line_number']}" for d in details] or ["?"]
                violations.append({"importer": importer, "imported": imported, "lines": ", ".join(lines)})
        output.verbose_print(verbose, f"{len(importers)} modules checked against {sorted(allowed)} + stdlib"
                                      + (f" (imports of {sorted(checked)} only)" if checked else ""))
        return ContractCheck(kept=not violations and not missing, metadata={"violations": violations, "missing": missing})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for name in check.metadata["missing"]:
            output.print_error(f"{name} is not in the import graph (a renamed module?)")
        for v in check.metadata["violations"]:
            output.print_error(f"{v['importer']} imports {v['imported']} ({v['lines']})", bold=False)
            output.new_line()
