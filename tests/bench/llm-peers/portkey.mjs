// Starts Portkey's gateway (node_modules/@portkey-ai/gateway, the npm
// package's own entry point) bound to 127.0.0.1 only: the package calls
// @hono/node-server's serve() without a hostname, which listens on every
// interface, so the first TCP listen() is pointed at loopback here.
// Arguments pass through (--port=N --headless).
import net from 'node:net';

const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === 'number' || (typeof args[0] === 'string' && /^\d+$/.test(args[0]))) {
    if (typeof args[1] === 'string' || args[1] === undefined || args[1] === null) args[1] = '127.0.0.1';
    else args.splice(1, 0, '127.0.0.1');
  } else if (args[0] && typeof args[0] === 'object' && args[0].path === undefined) {
    args[0] = { ...args[0], host: '127.0.0.1' };
  }
  return listen.apply(this, args);
};
await import('./node_modules/@portkey-ai/gateway/build/start-server.js');
