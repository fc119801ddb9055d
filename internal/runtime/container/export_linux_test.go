package container

// LookupInitBinary finds the init binary afresh (InitBinary keeps its
// first answer).
var LookupInitBinary = lookupInitBinary
