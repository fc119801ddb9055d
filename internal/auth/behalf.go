package auth

import (
	"encoding/base64"
	"encoding/json"
	"fmt"

	"github.com/containerd/errdefs"
)

// OnBehalfHeader carries, on a request made with an admin token, the
// token whose authority the request has instead: a gateway's client's
// (dsec gateway), which the worker then serves as it would that token
// (its scope, what it may, its quota, its policies). The worker takes it
// from admin tokens only.
const OnBehalfHeader = "Dsec-On-Behalf-Of"

// OnBehalf encodes t for OnBehalfHeader (its digest left out).
func OnBehalf(t Token) string {
	t.SHA256 = ""
	b, _ := json.Marshal(t)
	return base64.RawURLEncoding.EncodeToString(b)
}

// ParseOnBehalf decodes an OnBehalfHeader.
func ParseOnBehalf(s string) (Token, error) {
	var t Token
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err == nil {
		err = json.Unmarshal(b, &t)
	}
	if err == nil {
		err = CheckScope(t.Scope)
	}
	if err == nil && t.ID == "" {
		err = fmt.Errorf("no token id")
	}
	if err != nil {
		return Token{}, fmt.Errorf("bad %s header: %v: %w", OnBehalfHeader, err, errdefs.ErrInvalidArgument)
	}
	return t, nil
}
