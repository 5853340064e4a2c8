"""Operations with several implementations behind one validating host wrapper."""
