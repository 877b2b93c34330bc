# Type stub for the backend choice (src/lnfast/_dispatch.pyx).
from types import ModuleType

def backend(names: str, x: object, *others: object) -> ModuleType: ...
