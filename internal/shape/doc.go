// Package shape holds no code. Its test keeps the tree readable at a
// glance: no hand-written Go file over 800 lines, and no function
// outside the tests over 100 lines unless a line of its doc comment,
// starting "Long:", says why it is better left whole. Generated files
// (the "Code generated ... DO NOT EDIT." header) are left out, and so
// are test functions, which read as one scenario, step after step.
package shape
