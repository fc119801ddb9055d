package api

import (
	"errors"
	"fmt"

	"github.com/containerd/errdefs"
)

// ErrInfra marks failures of the sandbox, the worker or the host rather
// than of a command: a trainer retries these elsewhere instead of
// scoring them. It is errdefs' unavailable class, which is what crosses
// the wire; the worker's runtime and the SDK both wrap this one.
var ErrInfra = fmt.Errorf("infrastructure failure: %w", errdefs.ErrUnavailable)

// Error classes.
const (
	ClassInvalid        = "invalid"         // bad request: fix it
	ClassNotFound       = "not_found"       // no such sandbox, command, path, snapshot, layer, policy or pool (or not the token's)
	ClassExists         = "exists"          // the name (or path) is taken
	ClassState          = "state"           // the sandbox is in the wrong state (stopped, running)
	ClassInfra          = "infra"           // the sandbox died or the host failed: not the command's fault
	ClassLimit          = "limit"           // over a bound (a snapshot's size, entries, depth)
	ClassBusy           = "busy"            // the host is at capacity: queued until the admission timeout
	ClassDenied         = "denied"          // not allowed (a registry refusing the credentials, a token's scope)
	ClassUnauthorized   = "unauthorized"    // no valid token (the TCP API)
	ClassNotImplemented = "not_implemented" // not done here: by this backend, host or build, or by a gateway
	ClassDataLoss       = "data_loss"       // state on disk is damaged
	ClassInternal       = "internal"        // anything else
)

// errorTable is the one map of error classes: each class's errdefs
// error and HTTP status, in the order an error is matched against them
// (the worker's answer), and back from the class in an Error's body
// (the SDK's). An error of no class is ClassInternal, 500. The statuses
// are net/http's (TestErrorTableStatuses names them), written as numbers
// so that this package does not import net/http: a sandbox's init links
// it, and every package a process links is initialised at its start.
var errorTable = []struct {
	class  string
	err    error
	status int
}{
	{ClassLimit, errdefs.ErrOutOfRange, 413},              // Request Entity Too Large
	{ClassInvalid, errdefs.ErrInvalidArgument, 400},       // Bad Request
	{ClassNotFound, errdefs.ErrNotFound, 404},             // Not Found
	{ClassExists, errdefs.ErrAlreadyExists, 409},          // Conflict
	{ClassState, errdefs.ErrFailedPrecondition, 412},      // Precondition Failed
	{ClassInfra, errdefs.ErrUnavailable, 503},             // Service Unavailable
	{ClassBusy, errdefs.ErrResourceExhausted, 429},        // Too Many Requests
	{ClassDenied, errdefs.ErrPermissionDenied, 403},       // Forbidden
	{ClassUnauthorized, errdefs.ErrUnauthenticated, 401},  // Unauthorized
	{ClassNotImplemented, errdefs.ErrNotImplemented, 501}, // Not Implemented
	{ClassDataLoss, errdefs.ErrDataLoss, statusInternal},
}

// statusInternal is HTTP's 500, Internal Server Error.
const statusInternal = 500

// ErrorOf is err as the API answers it: its class, message and status.
func ErrorOf(err error) (*Error, int) {
	for _, r := range errorTable {
		if errors.Is(err, r.err) {
			return &Error{Class: r.class, Message: err.Error()}, r.status
		}
	}
	return &Error{Class: ClassInternal, Message: err.Error()}, statusInternal
}

// ClassOfStatus is the class an answer of this HTTP status has when its
// body says none (a proxy's, say).
func ClassOfStatus(status int) string {
	class := ClassInternal
	for _, r := range errorTable {
		if r.status == status && r.status != statusInternal {
			if class != ClassInternal { // a status two classes share
				return ClassInternal
			}
			class = r.class
		}
	}
	return class
}

// Unwrap gives the errdefs error of the class, nil for ClassInternal.
func (e *Error) Unwrap() error {
	for _, r := range errorTable {
		if r.class == e.Class {
			return r.err
		}
	}
	return nil
}
