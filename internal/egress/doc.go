// Package egress holds what domain-name egress rules need that is pure
// logic over untrusted bytes: the rules' name patterns and the names a
// sandbox sends (a DNS question, a TLS ClientHello's server name, an
// HTTP request's Host), each normalised the one way and matched.
//
// Terms:
//   - A name is a DNS name in its ASCII form: lowercase, no trailing
//     dot, internationalised labels as punycode (IDNA 2008, lookup
//     profile), each label 1-63 letters, digits or hyphens (an
//     underscore too, as service names use), 253 bytes at most.
//   - A pattern is what a rule's `to:` names: a name (exactly it),
//     "*.NAME" (exactly one more label in front of NAME, not NAME
//     itself) or "**.NAME" (one or more labels in front, at any
//     depth). NAME must have two labels or more: "*", "**" and
//     wildcards over a top-level domain ("*.com") open too much to be a
//     rule, and are refused.
//   - A hello is the first flight of a TLS client: one handshake
//     message, ClientHello, over one or more TLS records. Its server
//     name is the host_name of its server_name extension; a hello with
//     the encrypted_client_hello extension hides its real name.
package egress
