package container

// LookupInitBinary finds the init binary afresh (InitBinary keeps its
// first answer).
var LookupInitBinary = lookupInitBinary

// Spend is spend: a test runs it on the main thread.
var Spend = spend
