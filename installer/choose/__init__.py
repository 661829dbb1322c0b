"""What to install: the release manifest (manifest), its asset for this target (choose), the plan,
pure / fetch / compile and a compile's archs (plan), and the record of the choice every wheel
carries (install_record). Imports core only.
"""
