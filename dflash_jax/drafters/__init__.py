"""Drafter families behind the Drafter interface (`base`): DFlash (`dflash`, `dflash_names`)."""
