"""Expert iteration, `specrej-ray iterate`: round r generates with the current policy into
OUT/round-r/, trains on that round's file into OUT/round-r/model/, and the trained model is
the next round's generator. Every step is resumable; iterate.json keeps the rounds' record."""
