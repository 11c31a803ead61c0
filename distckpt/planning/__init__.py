"""Pure planning: validation and the save and read plans. No I/O, no communication."""
