"""`python -m auditor` is the same CLI as `audit` (launchers such as torchrun need `-m`)."""
from auditor.cli import main

if __name__ == "__main__":
    main()
