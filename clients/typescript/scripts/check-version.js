// Fails the build when src/index.ts's VERSION and package.json's version differ.
'use strict';
const pkg = require('../package.json');
const { VERSION } = require('../dist/index.js');
if (VERSION !== pkg.version) {
  console.error(`VERSION in src/index.ts is ${VERSION}, package.json says ${pkg.version}`);
  process.exit(1);
}
